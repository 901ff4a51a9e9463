"""`python -m bench`: argument parsing and the measuring loop (servers x load levels, interleaved)."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from tqdm import tqdm

from bench import report, servers, stress
from bench.client import RequestOptions, RequestResult, Target, discover_model, send_request
from bench.llama_peer import LlamaPeer, check_binary, resolve_gguf
from bench.runner import LevelResult, LoadShape, run_level
from bench.workload import LengthDist, TokenCounter, build_workload, load_token_counter

COMPARE_SERVERS = ("sluice", "transformers", "transformers-cb", "llama")
DEFAULT_URL = "http://127.0.0.1:8000"
LOADING_TIMEOUT = 600.0  # seconds a --url server may still be loading its model (503) before the run starts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Load generator for OpenAI-compatible servers.")
    p.add_argument("--url", help=f"base URL of the server to measure (default {DEFAULT_URL}; --soak and --abuse "
                   "start a Sluice server of their own when none is given)")
    p.add_argument("--model", help="model name to send (default: the first id of GET /v1/models)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_positive(int), default=8, help="closed loop: streams kept busy (default 8)")
    load.add_argument("--rate", type=_positive(float), help="open loop: Poisson arrivals per second")
    load.add_argument("--burst", type=_positive(int), nargs="?", const=256, help="send N requests at once (default 256)")
    p.add_argument("--sweep", type=_levels, help="comma-separated levels (concurrency, rate or burst size), "
                   "e.g. 1,4,16,64")
    p.add_argument("--num-requests", type=_num_requests, help="requests per level: N, or Kx for K per stream "
                   "(default: 4x, at least 16; 64 for --rate; the burst size for --burst)")
    p.add_argument("--max-duration", type=_positive(float), help="stop issuing requests after this many seconds per level")
    p.add_argument("--prompt-tokens", type=LengthDist.parse,
                   help="prompt length: 128, uniform:64:192, normal:128:32 or exp:128 "
                   "(default 128; --soak uniform:8:256)")
    p.add_argument("--output-tokens", type=LengthDist.parse,
                   help="max_tokens per request, same syntax (default 128; --soak uniform:4:64)")
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens of prompt prefix common to all requests")
    p.add_argument("--tokenizer", help="model folder whose tokenizer.json makes prompt lengths exact")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ask for exactly max_tokens)")
    p.add_argument("--no-usage", dest="include_usage", action="store_false",
                   help="do not send stream_options.include_usage (completion tokens are then counted from events)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests per server before measuring")
    p.add_argument("--seed", type=int, help="the prompts' seed (default: a new one each run, printed: a server's "
                   "prefix cache would serve a second run of the same prompts). Each level adds its index to it")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as a bearer token to --url and --peer servers (default: $OPENAI_API_KEY)")
    p.add_argument("--timeout", type=_positive(float), default=600.0, help="per-request limit in seconds")
    p.add_argument("--health-interval", type=float, default=0.05, help="seconds between GET /health; 0 disables")
    p.add_argument("--json", help="write the summaries and every request's timings to this file")
    p.add_argument("--plot", help="write latency CDFs and throughput to this PNG")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument("--from-json", help="measure nothing: print (and --plot) the results of an earlier --json file")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--peer", action="append", default=[], help="another OpenAI-compatible server: URL or NAME=URL")
    p.add_argument("--compare", action="store_true",
                   help="start Sluice, transformers serve (with and without continuous batching) and llama-server "
                   "and measure all")
    p.add_argument("--servers", default=",".join(COMPARE_SERVERS), help="which servers --compare starts")
    p.add_argument("--hf-model-dir", help="Hugging Face folder for transformers serve (default: Sluice's cache)")
    p.add_argument("--sluice-model", help="--model passed to the Sluice server (default: its config)")
    p.add_argument("--sluice-arg", action="append", default=[], help="extra Sluice flag, e.g. --sluice-arg=--max-pending=64")
    p.add_argument("--transformers-dtype", default="bfloat16", help="--dtype for transformers serve (default %(default)s)")
    p.add_argument("--log-dir", default="bench/results/logs", help="where started servers write their logs")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary for --compare (without it the peer is skipped)")
    p.add_argument("--llama-model", help="GGUF file for llama-server (default: the GGUF Sluice serves)")
    p.add_argument("--llama-parallel", type=int, default=32, help="llama-server slots for --rate levels "
                   "(closed loop and burst levels use their stream count; default %(default)s)")
    hostile = p.add_argument_group("soak and abuse (loopback servers only)")
    modes = hostile.add_mutually_exclusive_group()
    modes.add_argument("--soak", action="store_true", help="mixed streams, disconnects, never-read clients and bad "
                       "input for --duration s; the server's RSS, fds and threads at rest at the start and the end")
    modes.add_argument("--abuse", action="store_true", help="/health latency while bad input is sent and rejected")
    hostile.add_argument("--duration", type=float, help="seconds of load (default 600 for --soak, 30 for --abuse)")
    hostile.add_argument("--server-pid", type=int, help="PID of the server at --url, for its /proc figures "
                         "(default: the process listening on its port, when readable)")
    hostile.add_argument("--abusers", type=int, default=4, help="--abuse: clients sending bad input (default %(default)s)")
    hostile.add_argument("--warmup-concurrency", type=int, default=32, help="--soak: streams of the KV warm-up")
    hostile.add_argument("--warmup-prompt-tokens", type=int, default=896, help="--soak: prompt length of the warm-up")
    hostile.add_argument("--warmup-output-tokens", type=int, default=128, help="--soak: output length of the warm-up")
    hostile.add_argument("--block-size", type=int, default=16, help="--soak: server's tokens per KV block (sizes the warm-up)")
    hostile.add_argument("--long-output-tokens", type=int, default=1024,
                         help="--soak: max_tokens of clients that disconnect or never read (default %(default)s)")
    hostile.add_argument("--never-read-seconds", type=float, default=20.0, help="--soak: how long a never-read client holds on")
    hostile.add_argument("--checkpoints", type=int, default=3,
                         help="--soak: rests with figures during the soak, the last at the end (default %(default)s)")
    hostile.add_argument("--settle-seconds", type=float, default=30.0, help="--soak: longest wait at rest before a figure")
    args = p.parse_args(argv)
    if (args.soak or args.abuse) and (args.compare or args.sweep or args.peer):
        p.error("--soak and --abuse take one server (--url, or one they start): not --compare, --sweep or --peer")
    if not args.soak:
        args.prompt_tokens = args.prompt_tokens or LengthDist.parse("128")
        args.output_tokens = args.output_tokens or LengthDist.parse("128")
    if args.compare and not set(args.servers.split(",")) <= set(COMPARE_SERVERS):
        p.error(f"--servers takes a subset of {','.join(COMPARE_SERVERS)}")
    if args.sweep and args.rate is None and any(v != int(v) for v in args.sweep):
        p.error("--sweep: streams and burst sizes are whole numbers (fractions are --rate levels)")
    if args.seed is None:
        args.seed = random.randrange(1 << 31)
        if not args.from_json:
            print(f"bench: prompts from --seed {args.seed} (pass it to send the same prompts again)", file=sys.stderr)
    return args


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: a positive {kind.__name__}")
        return value

    return parse


def _levels(text: str) -> list[float]:
    try:
        levels = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated numbers, e.g. 1,4,16") from None
    if any(v <= 0 for v in levels):
        raise argparse.ArgumentTypeError(f"{text!r}: load levels must be positive")
    return levels


def _num_requests(text: str) -> str:
    try:
        value = float(text[:-1]) if text.endswith("x") else int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive count N, or Kx for K per stream")
    return text


def load_shapes(args: argparse.Namespace) -> list[LoadShape]:
    mode = "rate" if args.rate is not None else "burst" if args.burst is not None else "closed"
    default = {"closed": args.concurrency, "rate": args.rate, "burst": args.burst}[mode]
    levels = args.sweep or [float(default)]
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
) -> tuple[list[Target], str | None, dict[str, servers.ManagedServer], LlamaPeer | None]:
    """Starts each server and waits for it before the next, so model loads do not fight over the cores.
    llama-server is only set up here: it starts at each level, with that level's number of slots."""
    wanted = args.servers.split(",")
    llama = None
    if "llama" in wanted:
        wanted.remove("llama")
        binary = check_binary(args.llama_server)
        if binary is not None:
            llama = LlamaPeer(binary, resolve_gguf(args.llama_model, args.sluice_model), Path(args.log_dir),
                              args.startup_timeout, args.llama_parallel)
            stack.callback(llama.stop)
    hf_dir = servers.resolve_hf_model_dir(args.hf_model_dir)
    if any(name.startswith("transformers") for name in wanted):
        if hf_dir is None:
            raise SystemExit("bench: transformers serve needs a Hugging Face folder: pass --hf-model-dir PATH")
        if hf_dir.endswith(".gguf"):
            hf_dir = str(servers.hf_folder_of_gguf(Path(hf_dir)))
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
        server = await servers.start_ready(name, command, target, Path(args.log_dir), stack, args.startup_timeout)
        started.append(target)
        managed[name] = server
    if llama is not None:
        started.append(llama.target)
    return started, hf_dir, managed, llama


async def prepare_target(target: Target, specs: list, options: RequestOptions, warmup: int) -> Target:
    # A client of its own for the probes: a server that answers /v1/models with a 500 (transformers serve
    # without a hub cache) closes that connection, and a warm-up request reusing it would fail.
    async with httpx.AsyncClient(timeout=30.0) as probe:
        try:
            deadline = time.monotonic() + LOADING_TIMEOUT
            # a server given by --url may still be loading its model (503): its model id comes once it is ready
            while time.monotonic() < deadline:
                if (await probe.get(target.root + "/v1/models", headers=target.headers)).status_code != 503:
                    break
                await asyncio.sleep(0.5)
        except httpx.HTTPError as exc:
            raise SystemExit(f"bench: cannot reach {target.name} at {target.root}: {exc or type(exc).__name__}") from None
        if target.model is None:
            target = replace(target, model=await discover_model(probe, target))
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
    llama: LlamaPeer | None = None,
) -> tuple[list[Target], list[LevelResult]]:
    options = RequestOptions(args.endpoint, args.temperature, args.ignore_eos, args.include_usage, args.timeout)
    warm = build_workload(args.warmup, args.prompt_tokens, LengthDist("fixed", 16), args.seed + 7919, counter=counter)
    cores = os.cpu_count() or 1
    if os.getloadavg()[0] > cores:
        print(f"bench: load average {os.getloadavg()[0]:.1f} on {cores} cores: other work is running and will skew "
              "the figures (each level's load average is in the JSON)", file=sys.stderr)
    started = started if started is not None else {}
    is_lazy = {t.name: llama is not None and t.name == llama.target.name for t in targets}
    targets = [t if is_lazy[t.name] else await prepare_target(t, warm, options, args.warmup) for t in targets]
    levels = []
    for level, shape in enumerate(load_shapes(args)):
        # Prompts of their own per level: a level sending the last one's again would meet them in the prefix cache.
        specs = build_workload(num_requests(args, shape), args.prompt_tokens, args.output_tokens, args.seed + level,
                               args.shared_prefix, counter)
        for i, target in enumerate(targets):  # interleaved: every server at this level before the next level
            if is_lazy[target.name]:
                servers.focus(started, target.name)  # the others pause while it loads
                if await llama.ensure(shape, started):
                    targets[i] = target = await prepare_target(target, warm, options, args.warmup)
            servers.focus(started, target.name)
            levels.append(await _run_with_progress(args, target, specs, shape, options))
            if args.json:  # after every level: an interrupted run keeps what it measured
                report.write_json(args.json, levels, run_config(args, targets))
    servers.focus(started, None)
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
        if args.soak or args.abuse:
            return await stress.run(args, stack)
        targets: list[Target] = []
        hf_dir = None
        started: dict[str, servers.ManagedServer] = {}
        llama = None
        if args.compare:
            targets, hf_dir, started, llama = await start_servers(args, stack)
        else:
            url = args.url or DEFAULT_URL
            targets = [Target(urlsplit(url).netloc or url, url, args.model, api_key=args.api_key)]
        targets += [replace(peer_target(spec), api_key=args.api_key) for spec in args.peer]
        tokenizer_dir = args.tokenizer or hf_dir
        counter = load_token_counter(tokenizer_dir) if tokenizer_dir else None
        targets, levels = await measure(args, targets, counter, started, llama)
    if args.json:
        print(f"bench: wrote {args.json}", file=sys.stderr)
    show(args, levels)
    failed = [f"{lv.target} at {lv.shape.level:g}" for lv in levels
              if lv.requests and all(r.outcome != "ok" for r in lv.requests)]  # fmt: skip
    if failed:  # a script or CI running the bench learns that nothing was measured
        print(f"bench: every request failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        show(args, report.read_json(args.from_json)[0])
        return 0
    began = time.time()
    try:
        return asyncio.run(run(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        wrote = args.json and os.path.exists(args.json) and os.path.getmtime(args.json) >= began  # by this run
        kept = f" (the levels that finished are in {args.json}: --from-json {args.json} prints them)" if wrote else ""
        print(f"bench: interrupted{kept}", file=sys.stderr)
        return 130
