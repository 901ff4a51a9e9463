"""`python -m bench`: argument parsing and the measuring loop (servers x load levels, interleaved)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from tqdm import tqdm

from bench import report, servers
from bench.client import RequestOptions, RequestResult, Target, discover_model, send_request
from bench.runner import LevelResult, LoadShape, run_level
from bench.workload import LengthDist, TokenCounter, build_workload, load_token_counter

COMPARE_SERVERS = ("sluice", "transformers", "transformers-cb")
DEFAULT_URL = "http://127.0.0.1:8000"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description="Load generator for OpenAI-compatible servers.")
    p.add_argument("--url", default=DEFAULT_URL, help="base URL of the server to measure (default %(default)s)")
    p.add_argument("--model", help="model name to send (default: the first id of GET /v1/models)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=8, help="closed loop: streams kept busy (default 8)")
    load.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    load.add_argument("--burst", type=int, nargs="?", const=256, help="send N requests at once (default 256)")
    p.add_argument("--sweep", help="comma-separated levels (concurrency, rate or burst size), e.g. 1,4,16,64")
    p.add_argument("--num-requests", help="requests per level: N, or Kx for K per stream (default: 4x, at least 16; "
                   "64 for --rate; the burst size for --burst)")
    p.add_argument("--max-duration", type=float, help="stop issuing requests after this many seconds per level")
    p.add_argument("--prompt-tokens", type=LengthDist.parse, default=LengthDist.parse("128"),
                   help="prompt length: 128, uniform:64:192, normal:128:32 or exp:128 (default 128)")
    p.add_argument("--output-tokens", type=LengthDist.parse, default=LengthDist.parse("128"),
                   help="max_tokens per request, same syntax (default 128)")
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens of prompt prefix common to all requests")
    p.add_argument("--tokenizer", help="model folder whose tokenizer.json makes prompt lengths exact")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ask for exactly max_tokens)")
    p.add_argument("--no-usage", dest="include_usage", action="store_false",
                   help="do not send stream_options.include_usage (completion tokens are then counted from events)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests per server before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request limit in seconds")
    p.add_argument("--health-interval", type=float, default=0.05, help="seconds between GET /health; 0 disables")
    p.add_argument("--json", help="write the summaries and every request's timings to this file")
    p.add_argument("--plot", help="write latency CDFs and throughput to this PNG")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument("--from-json", help="measure nothing: print (and --plot) the results of an earlier --json file")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--peer", action="append", default=[], help="another OpenAI-compatible server: URL or NAME=URL")
    p.add_argument("--compare", action="store_true",
                   help="start Sluice and transformers serve (with and without continuous batching) and measure all")
    p.add_argument("--servers", default=",".join(COMPARE_SERVERS), help="which servers --compare starts")
    p.add_argument("--hf-model-dir", help="Hugging Face folder for transformers serve (default: Sluice's cache)")
    p.add_argument("--sluice-model", help="--model passed to the Sluice server (default: its config)")
    p.add_argument("--sluice-arg", action="append", default=[], help="extra Sluice flag, e.g. --sluice-arg=--max-pending=64")
    p.add_argument("--transformers-dtype", default="bfloat16", help="--dtype for transformers serve (default %(default)s)")
    p.add_argument("--log-dir", default="bench/results/logs", help="where started servers write their logs")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.compare and not set(args.servers.split(",")) <= set(COMPARE_SERVERS):
        p.error(f"--servers takes a subset of {','.join(COMPARE_SERVERS)}")
    return args


def load_shapes(args: argparse.Namespace) -> list[LoadShape]:
    mode = "rate" if args.rate is not None else "burst" if args.burst is not None else "closed"
    default = {"closed": args.concurrency, "rate": args.rate, "burst": args.burst}[mode]
    levels = [float(v) for v in args.sweep.split(",")] if args.sweep else [float(default)]
    if any(v <= 0 for v in levels):
        raise SystemExit("bench: load levels must be positive")
    return [LoadShape(mode, level, args.max_duration, args.seed) for level in levels]


def num_requests(args: argparse.Namespace, shape: LoadShape) -> int:
    spec = args.num_requests
    if shape.mode == "burst":
        return int(shape.level)
    if spec is None:
        return max(16, 4 * int(shape.level)) if shape.mode == "closed" else 64
    if spec.endswith("x"):
        return max(1, round(float(spec[:-1]) * shape.level))
    return int(spec)


def peer_target(spec: str) -> Target:
    name, _, url = spec.partition("=") if "=" in spec.split("://")[0] else ("", "", spec)
    return Target(name or urlsplit(url).netloc, url)


async def start_servers(
    args: argparse.Namespace, stack: ExitStack
) -> tuple[list[Target], str | None, dict[str, servers.ManagedServer]]:
    """Starts each server and waits for it before the next, so model loads do not fight over the cores."""
    wanted = args.servers.split(",")
    hf_dir = servers.resolve_hf_model_dir(args.hf_model_dir)
    if hf_dir is None and any(name.startswith("transformers") for name in wanted):
        raise SystemExit("bench: transformers serve needs a Hugging Face folder: pass --hf-model-dir PATH")
    started: list[Target] = []
    managed: dict[str, servers.ManagedServer] = {}
    for name in wanted:
        port = servers.free_port()
        url = f"http://127.0.0.1:{port}"
        if name == "sluice":
            command = servers.sluice_command(port, args.sluice_model, args.sluice_arg)
            target = Target(name, url, args.model, "sluice")
        else:
            command = servers.transformers_command(port, hf_dir, name.endswith("-cb"), args.transformers_dtype)
            target = Target(name, url, hf_dir, "transformers")  # it only accepts the name it was started with
        server = servers.start(name, command, target, Path(args.log_dir))
        stack.callback(servers.stop, server)
        print(f"bench: waiting for {name} ({server.log_path})", file=sys.stderr)
        await servers.wait_ready(server, args.startup_timeout)
        started.append(target)
        managed[name] = server
    return started, hf_dir, managed


async def prepare_target(target: Target, specs: list, options: RequestOptions, warmup: int) -> Target:
    # A client of its own for the probes: a server that answers /v1/models with a 500 (transformers serve
    # without a hub cache) closes that connection, and a warm-up request reusing it would fail.
    async with httpx.AsyncClient(timeout=30.0) as probe:
        try:
            await probe.get(target.root + "/v1/models")
        except httpx.HTTPError as exc:
            raise SystemExit(f"bench: cannot reach {target.name} at {target.root}: {exc or type(exc).__name__}") from None
        if target.model is None:
            target = Target(target.name, target.base_url, await discover_model(probe, target), target.flavor)
    async with httpx.AsyncClient(timeout=httpx.Timeout(options.timeout)) as client:
        for spec in specs[:warmup]:
            result = await send_request(client, target, spec, options, 0.0)
            if result.error:
                print(f"bench: warm-up request to {target.name} failed: {result.error}", file=sys.stderr)
    return target


async def measure(
    args: argparse.Namespace,
    targets: list[Target],
    counter: TokenCounter | None,
    started: dict[str, servers.ManagedServer] | None = None,
) -> tuple[list[Target], list[LevelResult]]:
    options = RequestOptions(args.endpoint, args.temperature, args.ignore_eos, args.include_usage, args.timeout)
    warm = build_workload(args.warmup, args.prompt_tokens, LengthDist("fixed", 16), args.seed + 7919, counter=counter)
    cores = os.cpu_count() or 1
    if os.getloadavg()[0] > cores:
        print(f"bench: load average {os.getloadavg()[0]:.1f} on {cores} cores: other work is running and will skew "
              "the figures (each level's load average is in the JSON)", file=sys.stderr)
    targets = [await prepare_target(t, warm, options, args.warmup) for t in targets]
    levels = []
    for shape in load_shapes(args):
        specs = build_workload(num_requests(args, shape), args.prompt_tokens, args.output_tokens, args.seed,
                               args.shared_prefix, counter)
        for target in targets:  # interleaved: every server at this level before the next level
            servers.focus(started or {}, target.name)
            levels.append(await _run_with_progress(args, target, specs, shape, options))
            if args.json:  # after every level: an interrupted run keeps what it measured
                report.write_json(args.json, levels, run_config(args, targets))
    servers.focus(started or {}, None)
    return targets, levels


def run_config(args: argparse.Namespace, targets: list[Target]) -> dict[str, Any]:
    plain = (int, float, str, bool, list, type(None))
    config: dict[str, Any] = {k: v if isinstance(v, plain) else str(v) for k, v in vars(args).items()}
    config["targets"] = [{"name": t.name, "url": t.base_url, "model": t.model, "flavor": t.flavor} for t in targets]
    return config


async def _run_with_progress(args: argparse.Namespace, target: Target, specs: list, shape: LoadShape,
                             options: RequestOptions) -> LevelResult:
    bar = tqdm(total=len(specs), desc=f"{target.name} {shape.label()}", unit="req", disable=args.no_progress,
               file=sys.stderr, leave=True)
    counts = {"429": 0, "error": 0}

    def on_done(result: RequestResult) -> None:
        if result.outcome in counts:
            counts[result.outcome] += 1
            bar.set_postfix(counts, refresh=False)
        bar.update()

    try:
        return await run_level(target, specs, shape, options, args.health_interval or None, on_done)
    finally:
        bar.close()


def show(args: argparse.Namespace, levels: list[LevelResult]) -> None:
    print(report.table(levels, args.markdown))
    server_side = report.server_table(levels, args.markdown)
    if server_side:
        print("\n" + server_side)
    if args.plot:
        report.plot(args.plot, levels)
        print(f"bench: wrote {args.plot}", file=sys.stderr)


async def run(args: argparse.Namespace) -> int:
    # SIGINT too: a shell starts background jobs with SIGINT ignored, and Python then installs no handler.
    # Cancelling the main task unwinds through the ExitStack, which stops the servers we started.
    loop, main_task = asyncio.get_running_loop(), asyncio.current_task()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main_task.cancel)
    with ExitStack() as stack:
        targets: list[Target] = []
        hf_dir = None
        started: dict[str, servers.ManagedServer] = {}
        if args.compare:
            targets, hf_dir, started = await start_servers(args, stack)
        else:
            targets = [Target(urlsplit(args.url).netloc or args.url, args.url, args.model)]
        targets += [peer_target(spec) for spec in args.peer]
        tokenizer_dir = args.tokenizer or hf_dir
        counter = load_token_counter(tokenizer_dir) if tokenizer_dir else None
        targets, levels = await measure(args, targets, counter, started)
    if args.json:
        print(f"bench: wrote {args.json}", file=sys.stderr)
    show(args, levels)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        show(args, report.read_json(args.from_json)[0])
        return 0
    try:
        return asyncio.run(run(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("bench: interrupted", file=sys.stderr)
        return 130
