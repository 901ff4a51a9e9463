"""Speculative decoding on the server: Sluice with speculation off, Sluice with it on ("auto" and/or "on"), and
llama.cpp's llama-server, on the same chats, greedy, streamed.

    python -m bench.speculative [--llama-server PATH] [--modes off,auto] [--open-streams 1,8,32]
                                [--grounded-requests 2] [--max-tokens 256] [--open-max-tokens 64]
                                [--open-rounds 3]

Workloads: input-grounded (bench/grounded_texts.py: quote, rewrite, copy-and-list, summarise a 300-600-token
text; one stream, --grounded-requests one after the other) and open-ended chat (ignore_eos, --open-max-tokens
each, at every --open-streams level: that many concurrent streams, --open-rounds requests each, so that a level
lasts long enough to tell a few percent). Reported per server and
level: decode tok/s per stream (tokens after the first over the time from the first to the last, the median of
the requests) and output tok/s in all (every output token over the level's wall time); then the ratios against
Sluice without speculation and against llama-server, measured in this run. Sluice's speculation counters come
from its /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from bench import llama_peer, servers
from bench.client import RequestOptions, Target, discover_model, send_request
from bench.grounded_texts import OPEN_ENDED, PASSAGES, TASKS
from bench.runner import make_client
from bench.workload import RequestSpec


def grounded_prompts(n: int) -> list[str]:
    return [f"{TASKS[i % len(TASKS)]}\n\n{PASSAGES[(i // len(TASKS)) % len(PASSAGES)]}" for i in range(n)]


async def run_level(target: Target, prompts: list[str], concurrency: int, max_tokens: int,
                    ignore_eos: bool) -> dict[str, float]:  # fmt: skip
    options = RequestOptions(temperature=0.0, ignore_eos=ignore_eos)
    specs = [RequestSpec(i, p, 0, max_tokens) for i, p in enumerate(prompts)]
    queue = list(specs)
    results = []
    async with make_client(concurrency) as client:
        start = time.perf_counter()

        async def worker() -> None:
            while queue:
                results.append(await send_request(client, target, queue.pop(0), options, start))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{target.name}: {len(errors)} requests failed: {errors[0]}")
    rates = []
    for r in results:
        decode_time = r.e2e - r.ttft if r.e2e is not None and r.ttft is not None else 0
        if r.completion_tokens > 1 and decode_time > 0:
            rates.append((r.completion_tokens - 1) / decode_time)
    tokens = sum(r.completion_tokens for r in results)
    return {"decode_tok_s": statistics.median(rates), "output_tok_s": tokens / wall, "tokens": tokens}


async def speculation_counters(target: Target) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=10.0) as client:
        text = (await client.get(target.root + "/metrics")).text
    counts: dict[str, float] = {}
    for name, value in re.findall(r'^sluice_speculative_(\w+?)_total\{proposer="\w+"\} ([0-9.e+]+)$', text, re.M):
        counts[name] = counts.get(name, 0.0) + float(value)
    return counts


async def measure(target: Target, args) -> dict[str, dict[str, float]]:
    async with httpx.AsyncClient(timeout=10.0) as client:
        target = Target(target.name, target.base_url, await discover_model(client, target), target.flavor)
    levels: dict[str, dict[str, float]] = {}
    await run_level(target, grounded_prompts(1), 1, 16, False)  # warm-up
    before = await speculation_counters(target) if target.flavor == "openai" else {}
    levels["grounded 1"] = await run_level(target, grounded_prompts(args.grounded_requests), 1, args.max_tokens, False)
    if before:
        after = await speculation_counters(target)
        steps = after.get("steps", 0) - before.get("steps", 0)
        if steps:
            levels["grounded 1"]["tokens_per_verify"] = (after["emitted_tokens"] - before["emitted_tokens"]) / steps
    print(f"bench: {target.name} grounded: {levels['grounded 1']}", file=sys.stderr)
    for n in args.open_streams:
        prompts = [OPEN_ENDED[i % len(OPEN_ENDED)] for i in range(n * args.open_rounds)]
        levels[f"open {n}"] = await run_level(target, prompts, n, args.open_max_tokens, True)
        print(f"bench: {target.name} {n} streams: {levels[f'open {n}']}", file=sys.stderr)
    return levels


async def main_async(args) -> None:
    log_dir = Path(args.log_dir)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for mode in args.modes:
        with ExitStack() as stack:
            port = servers.free_port()
            target = Target(f"sluice-{mode}", f"http://127.0.0.1:{port}/v1")
            command = servers.sluice_command(port, args.model, ["--speculative", mode])
            await servers.start_ready(target.name, command, target, log_dir, stack)
            results[target.name] = await measure(target, args)
    binary = llama_peer.check_binary(args.llama_server)
    if binary is not None:
        with ExitStack() as stack:
            port = servers.free_port()
            target = Target("llama-server", f"http://127.0.0.1:{port}/v1", flavor="llama")
            parallel = max(args.open_streams, default=1)
            command = llama_peer.llama_command(binary, llama_peer.resolve_gguf(None, args.model), port, parallel)
            await servers.start_ready(target.name, command, target, log_dir, stack)
            results[target.name] = await measure(target, args)
    report(results)


def report(results: dict[str, dict[str, dict[str, float]]]) -> None:
    names = list(results)
    levels = list(results[names[0]])
    print("| level | " + " | ".join(f"{n} decode tok/s (all tok/s)" for n in names) + " |")
    print("| --- |" + " --- |" * len(names))
    for level in levels:
        cells = []
        for n in names:
            r = results[n][level]
            extra = f", {r['tokens_per_verify']:.2f} tok/verify" if "tokens_per_verify" in r else ""
            cells.append(f"{r['decode_tok_s']:.1f} ({r['output_tok_s']:.1f}{extra})")
        print(f"| {level} | " + " | ".join(cells) + " |")
    base = results.get("sluice-off")
    peer = results.get("llama-server")
    for n in names:
        if n in ("sluice-off", "llama-server"):
            continue
        for level in levels:
            r = results[n][level]
            parts = []
            if base:
                parts.append(f"{r['decode_tok_s'] / base[level]['decode_tok_s']:.2f}x decode, "
                             f"{r['output_tok_s'] / base[level]['output_tok_s']:.2f}x all vs sluice-off")  # fmt: skip
            if peer:
                parts.append(f"{r['decode_tok_s'] / peer[level]['decode_tok_s']:.2f}x decode, "
                             f"{r['output_tok_s'] / peer[level]['output_tok_s']:.2f}x all vs llama-server")  # fmt: skip
            print(f"{n} {level}: " + "; ".join(parts))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Sluice's model (default: config.toml's)")
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (omitted: skipped)")
    parser.add_argument("--modes", default="off,auto", help="Sluice's --speculative values, off first")
    parser.add_argument("--open-streams", default="1,8,32")
    parser.add_argument("--grounded-requests", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--open-max-tokens", type=int, default=64)
    parser.add_argument("--open-rounds", type=int, default=3, help="requests per stream at each open level")
    parser.add_argument("--log-dir", default="/tmp/sluice-bench-speculative")
    args = parser.parse_args(argv)
    args.modes = args.modes.split(",")
    args.open_streams = [int(s) for s in args.open_streams.split(",") if s]
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
