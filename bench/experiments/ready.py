"""Time to ready: `python -m bench ready --sluice-model M [--llama-server BIN] --rounds 3`.

Each round starts Sluice with an empty cache folder of its own (a first start: the GGUF's config and tokenizer are
built and kept), again on that folder (a later start), and llama-server with each `--llama-parallel` slot count
(its context 2048 tokens a slot), one server at a time. A server is ready when `/v1/models` answers 200 (polled
every 10 ms); then one completion (a 150-token prompt, 8 tokens) is timed, as the first request a user would wait
on. Prints each start and the median of each kind.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import orjson

from bench import llama_peer, servers

PROMPT = "The quick brown fox jumps over the lazy dog. " * 15


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.read() if response.status == 200 else None
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def time_start(command: list[str], port: int, timeout: float, log: Path) -> tuple[float, float]:
    """(seconds until /v1/models answers, seconds of one 8-token completion after it)"""
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    started = time.monotonic()
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=servers.REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        while (models := _get(base + "/v1/models")) is None:
            if process.poll() is not None or time.monotonic() - started > timeout:
                raise RuntimeError(f"{command[0]} did not get ready; its log: {log}")
            time.sleep(0.01)
        ready = time.monotonic() - started
        body = {"model": orjson.loads(models)["data"][0]["id"], "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        request = urllib.request.Request(base + "/v1/completions", data=orjson.dumps(body),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        sent = time.monotonic()
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
        return ready, time.monotonic() - sent
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench ready", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sluice-model", default="", help="a GGUF or Hugging Face folder (default: the default model)")
    parser.add_argument("--llama-server", help="llama-server binary to start on the same GGUF")
    parser.add_argument("--llama-parallel", default="1,16", help="llama-server slot counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.llama_server and not args.sluice_model.endswith(".gguf"):
        parser.error("--llama-server needs --sluice-model PATH.gguf")
    log = Path(tempfile.gettempdir()) / "bench-ready.log"
    results: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        cache = Path(tempfile.mkdtemp(prefix="bench-ready-cache-"))
        try:
            for kind in ("sluice, first start", "sluice, later start"):
                port = servers.free_port()
                extra = ["--cache-dir", str(cache)]
                command = servers.sluice_command(port, args.sluice_model or None, extra)
                results.setdefault(kind, []).append(time_start(command, port, args.timeout, log))
                print(f"{kind}: ready {results[kind][-1][0]:.2f} s, first request {results[kind][-1][1]:.3f} s")
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        for parallel in [int(p) for p in args.llama_parallel.split(",")] if args.llama_server else []:
            kind = f"llama-server, {parallel} slots"
            port = servers.free_port()
            command = llama_peer.llama_command(args.llama_server, args.sluice_model, port, parallel)
            results.setdefault(kind, []).append(time_start(command, port, args.timeout, log))
            print(f"{kind}: ready {results[kind][-1][0]:.2f} s, first request {results[kind][-1][1]:.3f} s")
    print(f"\nmedians of {args.rounds} rounds ({Path(args.sluice_model).name or 'the default model'}):")
    for kind, runs in results.items():
        ready = statistics.median(r for r, _ in runs)
        first = statistics.median(f for _, f in runs)
        print(f"  {kind:<28} ready {ready:6.2f} s   first request {first:6.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
