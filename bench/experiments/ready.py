"""Time to ready: `python -m bench ready --sluice-model M [--llama-server BIN] --rounds 3`.

Each round starts Sluice with an empty cache folder of its own (a first start: the GGUF's config and tokenizer are
built and kept), again on that folder (a later start), and llama-server with each `--llama-parallel` slot count
(its context 2048 tokens a slot), one server at a time. A server is ready when it answers 200 (bench.servers'
wait_ready, polling every 10 ms); then one completion (a 150-token prompt, 8 tokens) is timed, as the first request
a user would wait on. Each round also times a process that only imports what a start imports (the part of a start
that no loading can shorten). Prints each start, the median of each kind and the ratios to llama-server's.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from bench import llama_peer, servers
from bench.client import Target, discover_model

PROMPT = "The quick brown fox jumps over the lazy dog. " * 15
POLL_SECONDS = 0.01
# What a start imports before it can answer (the server, the app, the engine and torch, transformers' base config
# and tokenizer), with the collector off as web.asgi.build_host runs them and transformers' import table kept.
START_IMPORTS = ("import gc; gc.disable(); import web.server, web.app, engine.llm_engine; "
                 "from engine.checkpoint import transformers_imports; from engine.config import EngineConfig; "
                 "transformers_imports.install(EngineConfig().cache_path); "
                 "import transformers.configuration_utils; from transformers import PreTrainedTokenizerFast")  # fmt: skip


async def _ready_and_first_request(server: servers.ManagedServer, timeout: float) -> tuple[float, float]:
    await servers.wait_ready(server, timeout, POLL_SECONDS)
    ready = time.monotonic() - server.started_at
    async with httpx.AsyncClient(timeout=timeout) as client:
        model = await discover_model(client, server.target)
        body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        sent = time.monotonic()
        response = await client.post(server.target.root + "/v1/completions", json=body)
        response.raise_for_status()
        return ready, time.monotonic() - sent


def time_start(name: str, command: list[str], port: int, timeout: float, log_dir: Path) -> tuple[float, float]:
    """(seconds until the server answers 200, seconds of one 8-token completion after it)"""
    server = servers.start(name, command, Target(name, f"http://127.0.0.1:{port}/v1"), log_dir)
    try:
        return asyncio.run(_ready_and_first_request(server, timeout))
    finally:
        servers.stop(server)


def time_imports() -> float:
    """Seconds a process takes to do only START_IMPORTS and exit."""
    begin = time.monotonic()
    subprocess.run([sys.executable, "-c", START_IMPORTS], cwd=servers.REPO_ROOT, check=True)
    return time.monotonic() - begin


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sluice-model", default="", help="a GGUF or Hugging Face folder (default: the default model)")
    parser.add_argument("--llama-server", help="llama-server binary to start on the same GGUF")
    parser.add_argument("--llama-parallel", default="1,16", help="llama-server slot counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.llama_server and args.sluice_model and not args.sluice_model.endswith(".gguf"):
        parser.error("--llama-server needs a GGUF model: --sluice-model PATH.gguf (or the default model)")
    gguf = llama_peer.resolve_gguf(None, args.sluice_model) if args.llama_server else None
    log_dir = Path(tempfile.gettempdir()) / "bench-ready"
    results: dict[str, list[tuple[float, float]]] = {}

    def measure(kind: str, name: str, command: list[str], port: int) -> None:
        results.setdefault(kind, []).append(time_start(name, command, port, args.timeout, log_dir))
        print(f"{kind}: ready {results[kind][-1][0]:.2f} s, first request {results[kind][-1][1]:.3f} s")

    imports: list[float] = []
    for _ in range(args.rounds):
        imports.append(time_imports())
        print(f"sluice's imports alone: {imports[-1]:.2f} s")
        cache = Path(tempfile.mkdtemp(prefix="bench-ready-cache-"))
        try:
            for kind in ("sluice, first start", "sluice, later start"):
                port = servers.free_port()
                command = servers.sluice_command(port, args.sluice_model or None, ["--cache-dir", str(cache)])
                measure(kind, "sluice", command, port)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        for parallel in [int(p) for p in args.llama_parallel.split(",")] if args.llama_server else []:
            port = servers.free_port()
            command = llama_peer.llama_command(args.llama_server, gguf, port, parallel)
            measure(f"llama-server, {parallel} slots", "llama", command, port)
    print(f"\nmedians of {args.rounds} rounds ({Path(args.sluice_model).name or 'the default model'}):")
    medians = {kind: statistics.median(r for r, _ in runs) for kind, runs in results.items()}
    for kind, runs in results.items():
        first = statistics.median(f for _, f in runs)
        print(f"  {kind:<28} ready {medians[kind]:6.2f} s   first request {first:6.3f} s")
    floor = statistics.median(imports)
    print(f"  {'sluice, imports alone':<28} ready {floor:6.2f} s")
    for kind in [k for k in medians if k.startswith("llama-server")]:
        print(f"  first start / {kind}: {medians['sluice, first start'] / medians[kind]:.2f}x, "
              f"later start: {medians['sluice, later start'] / medians[kind]:.2f}x "
              f"(the imports alone: {floor / medians[kind]:.2f}x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
