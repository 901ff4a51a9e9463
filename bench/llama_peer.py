"""llama.cpp's llama-server as a --compare peer, on the GGUF file Sluice serves.

Its slots are fixed at start (`-np`), so it is (re)started for each load level with as many slots as the
level has streams (a burst: its size; a Poisson rate: `--llama-parallel`), on 2 threads like the machine's
cores. Each slot gets `ctx_per_slot` tokens of context.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from bench import servers
from bench.client import Target
from bench.runner import LoadShape

NAME = "llama"
THREADS = 2
CTX_PER_SLOT = 2048
RATE_PARALLEL = 32  # slots for an open-loop (Poisson) level, which has no stream count


def llama_command(binary: str, gguf: str, port: int, parallel: int, threads: int = THREADS,
                  ctx_per_slot: int = CTX_PER_SLOT) -> list[str]:
    return [binary, "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(parallel), "--threads", str(threads), "--threads-batch", str(threads),
            "--ctx-size", str(parallel * ctx_per_slot), "--no-webui"]


def parallel_for(shape: LoadShape, rate_parallel: int = RATE_PARALLEL) -> int:
    return rate_parallel if shape.mode == "rate" else max(1, int(shape.level))


def check_binary(path: str | None) -> str | None:
    """The binary to run, or None (with a note: the peer is skipped) when no path was given."""
    if path is None:
        print(f"bench: {NAME}: skipped (no --llama-server PATH given; bench/build_llama_server.sh builds one)",
              file=sys.stderr)
        return None
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise SystemExit(f"bench: --llama-server {path!r} is not an executable file")
    return str(Path(path).resolve())


def resolve_gguf(explicit: str | None, sluice_model: str | None) -> str:
    """--llama-model, else Sluice's model when it is a GGUF file, else the default GGUF (found as the loader does)."""
    if explicit:
        return explicit
    if sluice_model is None:
        from engine.config import load_config

        sluice_model = load_config().engine.model
    if sluice_model == "":
        from engine.checkpoint.source import default_gguf_path

        return str(default_gguf_path())
    if sluice_model.endswith(".gguf"):
        return os.path.expanduser(sluice_model)
    raise SystemExit(f"bench: Sluice's model {sluice_model!r} is not a GGUF file: pass --llama-model FILE.gguf")


@dataclass
class LlamaPeer:
    binary: str
    gguf: str
    log_dir: Path
    startup_timeout: float = 600.0
    rate_parallel: int = RATE_PARALLEL
    port: int = 0
    server: servers.ManagedServer | None = None
    parallel: int | None = None

    def __post_init__(self) -> None:
        self.port = self.port or servers.free_port()

    @property
    def target(self) -> Target:
        return Target(NAME, f"http://127.0.0.1:{self.port}")

    async def ensure(self, shape: LoadShape, started: dict[str, servers.ManagedServer]) -> bool:
        """Runs the server with the slots `shape` needs; True when it was (re)started (it is cold then)."""
        parallel = parallel_for(shape, self.rate_parallel)
        if self.server is not None and self.server.process.poll() is None and self.parallel == parallel:
            return False
        self.stop()
        command = llama_command(self.binary, self.gguf, self.port, parallel)
        self.server = servers.start(f"{NAME}-np{parallel}", command, self.target, self.log_dir)
        started[NAME] = self.server
        print(f"bench: waiting for {NAME} with {parallel} slots ({self.server.log_path})", file=sys.stderr)
        await servers.wait_ready(self.server, self.startup_timeout)
        self.parallel = parallel
        return True

    def stop(self) -> None:
        if self.server is not None:
            servers.stop(self.server)
            self.server = None
