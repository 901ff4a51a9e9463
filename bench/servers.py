"""Servers started for --compare: free loopback ports, readiness polling, clean shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.client import Target
from bench.proc import read_memory

REPO_ROOT = Path(__file__).resolve().parent.parent
CB_NUM_BLOCKS = 256
CB_MAX_BATCH_TOKENS = 512


@dataclass
class ManagedServer:
    target: Target
    process: subprocess.Popen
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def sluice_command(port: int, model: str | None, extra_args: list[str]) -> list[str]:
    command = [sys.executable, "-m", "web.server", "--host", "127.0.0.1", "--port", str(port)]
    if model:
        command += ["--model", model]
    return command + extra_args


def transformers_command(port: int, model_dir: str, continuous_batching: bool, dtype: str) -> list[str]:
    # The CLI module rather than the `transformers` script: the script may not be on PATH outside the venv.
    command = [sys.executable, "-c", "from transformers.cli.transformers import main; main()", "serve", model_dir]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--device", "cpu"]
    if not continuous_batching:
        return command
    # Left alone, its KV cache takes 90% of free RAM on CPU (sized as for a GPU). 256 pages of 256 tokens
    # hold 64 streams of several hundred tokens; the batch token budget matches Sluice's default (512).
    return command + ["--continuous-batching", "--cb-num-blocks", str(CB_NUM_BLOCKS),
                      "--cb-max-batch-tokens", str(CB_MAX_BATCH_TOKENS)]


def start(name: str, command: list[str], target: Target, log_dir: Path) -> ManagedServer:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    env.pop("SLUICE_API_KEY", None)  # the servers the bench starts are its own: open, as it measures them
    with open(log_path, "wb") as log:
        # A session of its own, so stop() can signal the server and any helper process it forks.
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return ManagedServer(target, process, log_path)


async def start_ready(name: str, command: list[str], target: Target, log_dir: Path, stack: ExitStack,
                      timeout: float = 600.0) -> ManagedServer:
    """start() and wait_ready(), with the stop registered on `stack` first (a server that never gets ready is
    stopped too)."""
    server = start(name, command, target, log_dir)
    stack.callback(stop, server)
    print(f"bench: waiting for {name} ({server.log_path})", file=sys.stderr)
    await wait_ready(server, timeout)
    return server


async def wait_ready(server: ManagedServer, timeout: float = 600.0, interval: float = 0.5) -> None:
    """Polls /health (then /v1/models, for servers without it) every `interval` s until 200; fails fast if the
    process died."""
    deadline = time.monotonic() + timeout
    root = server.target.root
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(
                    f"{server.target.name} exited with code {server.process.returncode}; log tail:\n{server.log_tail()}"
                )
            for path in ("/health", "/v1/models"):
                try:
                    response = await client.get(root + path)
                except httpx.HTTPError:
                    break
                if response.status_code == 200:
                    _report_memory(server, f"ready after {time.monotonic() - server.started_at:.1f} s")
                    return
                if response.status_code != 404:
                    break
            await asyncio.sleep(interval)
    raise TimeoutError(f"{server.target.name} not ready after {timeout:g} s; log tail:\n{server.log_tail()}")


def focus(started: dict[str, ManagedServer], name: str | None) -> None:
    """Pause (SIGSTOP) every started server but `name` (None: resume all). An idle peer is not idle on this
    CPU (transformers serve --continuous-batching keeps a core busy), so it must not run while another is measured."""
    for server_name, server in started.items():
        if server.process.poll() is None:
            is_measured = name is None or server_name == name
            os.killpg(server.process.pid, signal.SIGCONT if is_measured else signal.SIGSTOP)


def _report_memory(server: ManagedServer, when: str) -> None:
    """The server process's resident memory now and its peak so far (the peak at stop covers load and run)."""
    try:
        rss, peak = read_memory(server.process.pid)
    except (OSError, KeyError, ValueError):
        return
    print(f"bench: {server.target.name} {when}: RSS {rss >> 20} MiB, peak RSS {peak >> 20} MiB", file=sys.stderr)


def stop(server: ManagedServer, grace: float = 30.0) -> None:
    if server.process.poll() is not None:
        return
    _report_memory(server, "at stop")
    try:
        os.killpg(server.process.pid, signal.SIGCONT)  # a paused server cannot handle SIGTERM
        os.killpg(server.process.pid, signal.SIGTERM)
        server.process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()
    except ProcessLookupError:
        pass


def hf_folder_of_gguf(gguf: Path) -> Path:
    """A Hugging Face folder of a GGUF's dequantised weights, for transformers serve (which takes no GGUF): written
    once under Sluice's cache (bench/), float32, the values Sluice and transformers' GGUF loader both read. A
    peer's copy only: Sluice itself never converts a model."""
    from engine.config import load_config

    folder = load_config().engine.cache_path / "bench" / f"{gguf.stem}-hf"
    if (folder / ".complete").exists():
        return folder
    print(f"bench: writing {folder} from {gguf.name} for transformers serve (once)", file=sys.stderr)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = {"pretrained_model_name_or_path": gguf.parent, "gguf_file": gguf.name}
    loaded = AutoModelForCausalLM.from_pretrained(**where, dtype="float32")
    plain = AutoModelForCausalLM.from_config(loaded.config, dtype="float32")  # a GGUF-loaded model will not save
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(folder)
    AutoTokenizer.from_pretrained(**where).save_pretrained(folder)
    (folder / ".complete").touch()  # a folder cut short by Ctrl-C is written again next time
    return folder


def resolve_hf_model_dir(explicit: str | None) -> str | None:
    """The explicit path, else the model Sluice serves (a Hugging Face folder or a GGUF file)."""
    if explicit:
        return explicit
    try:
        from engine.checkpoint.source import model_path
        from engine.config import load_config
    except ImportError:
        return None
    try:
        path = model_path(load_config().engine.model)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"bench: could not resolve Sluice's model folder: {exc}", file=sys.stderr)
        return None
    return str(path) if path else None
