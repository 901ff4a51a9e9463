"""`python -m bench cluster`: Sluice with engine replicas against one process, in one run.

Servers, one after the other on free loopback ports (the default model unless --model): one process with
2 compute threads, then 2 replicas x 1 thread for each routing policy (affine, round_robin, least_loaded).
- throughput: 32 streams of independent prompts, on the single process and on affine replicas;
- conversations: bench/conversations.py (many users, a long shared system prompt, multi-turn, interleaved)
  on every server: prefix-hit rate, TTFT, throughput, by policy;
- front: 64 streams against the replicas: time to headers p99 and /health p99 (probed from a process of its own),
  and against the single process (no Ray, no hop: what the same 2 cores give one process).
Prints one JSON summary (and writes it to --out); the targets of issue 20 are checked as ratios of this run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx

from bench import servers
from bench.client import RequestOptions, Target, discover_model
from bench.conversations import ConversationShape, run_conversations
from bench.runner import LoadShape, run_level
from bench.workload import LengthDist, build_workload

POLICIES = ("affine", "round_robin", "least_loaded")
PHASES = ("throughput", "conversations", "front")
LOG_DIR = servers.REPO_ROOT / "bench" / "results" / "logs"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


async def throughput(target: Target, num_streams: int, output_tokens: int) -> dict[str, Any]:
    specs = build_workload(num_streams, LengthDist.parse("128"), LengthDist.parse(str(output_tokens)), seed=1)
    level = await run_level(target, specs, LoadShape("closed", num_streams), RequestOptions(), health_interval=None)
    s = level.summary()
    return {"output_tok_s": s["output_tokens_per_s"], "completed": s["completed"], "errors": s["errors"]}


async def front_overhead(target: Target, num_streams: int) -> dict[str, Any]:
    # Long enough for the /health prober (a process of its own, slow to start on a busy machine) to sample it.
    specs = build_workload(num_streams * 4, LengthDist.parse("64"), LengthDist.parse("32"), seed=2)
    level = await run_level(target, specs, LoadShape("closed", num_streams), RequestOptions(), health_interval=0.05)
    s = level.summary()
    return {"headers_p99_s": s["admission_s"]["p99"], "health_p99_s": s["health_s"]["p99"],
            "completed": s["completed"], "rejected_429": s["rejected_429"]}  # fmt: skip


async def measure(name: str, extra: list[str], args: argparse.Namespace, phases: set[str]) -> dict[str, Any]:
    port = servers.free_port()
    target = Target(name, f"http://127.0.0.1:{port}/v1", model=None)
    command = servers.sluice_command(port, args.model, extra + args.server_args.split())
    results: dict[str, Any] = {"args": extra}
    with ExitStack() as stack:
        await servers.start_ready(name, command, target, LOG_DIR, stack, timeout=args.start_timeout)
        async with httpx.AsyncClient(timeout=30) as client:
            target = replace(target, model=await discover_model(client, target))
        if "throughput" in phases:
            results["throughput"] = await throughput(target, args.streams, args.output_tokens)
            print(f"bench.cluster: {name} throughput {results['throughput']}", file=sys.stderr)
        if "conversations" in phases:
            shape = conversation_shape(args)
            run = await run_conversations(target.root, target.model, shape)
            results["conversations"] = run.summary()
            print(f"bench.cluster: {name} conversations {results['conversations']}", file=sys.stderr)
        if "front" in phases:
            results["front"] = await front_overhead(target, args.front_streams)
            print(f"bench.cluster: {name} front {results['front']}", file=sys.stderr)
    return results


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(r: dict[str, Any]) -> dict[str, Any]:
    """Issue 20's targets as ratios of this run."""
    single, affine, rr = r.get("single", {}), r.get("affine", {}), r.get("round_robin", {})
    conv = {k: v.get("conversations", {}) for k, v in (("single", single), ("affine", affine), ("rr", rr))}
    out: dict[str, Any] = {
        "throughput_2x1_over_1x2 (>= 0.9)": ratio(affine.get("throughput", {}).get("output_tok_s"),
                                                  single.get("throughput", {}).get("output_tok_s")),
        "hit_rate_affine_over_single (>= 0.9)": ratio(conv["affine"].get("prefix_hit_rate"),
                                                      conv["single"].get("prefix_hit_rate")),
        "hit_rate_affine_over_round_robin (>= 1.8)": ratio(conv["affine"].get("prefix_hit_rate"),
                                                           conv["rr"].get("prefix_hit_rate")),
        "ttft_p50_round_robin_over_affine (>= 1.5)": ratio(conv["rr"].get("ttft_p50"), conv["affine"].get("ttft_p50")),
    }  # fmt: skip
    front = affine.get("front", {})
    out["headers_p99_ms (< 50)"] = front.get("headers_p99_s") and front["headers_p99_s"] * 1000
    out["health_p99_ms (< 10)"] = front.get("health_p99_s") and front["health_p99_s"] * 1000
    alone = single.get("front", {})  # the same load on one process: the machine's share of the latency
    out["single_process_headers_p99_ms"] = alone.get("headers_p99_s") and alone["headers_p99_s"] * 1000
    out["single_process_health_p99_ms"] = alone.get("health_p99_s") and alone["health_p99_s"] * 1000
    return out


def conversation_shape(args: argparse.Namespace) -> ConversationShape:
    return ConversationShape(args.users, args.turns, args.system_words, args.user_words, args.answer_tokens,
                             think_seconds=args.think_seconds)  # fmt: skip


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"cpu": cpu_name(), "shape": asdict(conversation_shape(args))}
    wanted, phases_wanted = set(args.servers.split(",")), set(args.phases.split(","))
    if "single" in wanted:
        results["single"] = await measure("single", ["--num-threads", "2"], args, set(PHASES) & phases_wanted)
    for policy in POLICIES:
        if policy in wanted:
            phases = (set(PHASES) if policy == "affine" else {"conversations"}) & phases_wanted
            extra = ["--replicas", "2", "--num-threads", "1", "--routing", policy]
            results[policy] = await measure(policy, extra, args, phases)
    results["targets"] = targets(results)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="the model of every server (default: Sluice's default)")
    parser.add_argument("--servers", default="single," + ",".join(POLICIES), help="a subset, comma-separated")
    parser.add_argument("--phases", default=",".join(PHASES), help="a subset, comma-separated")
    parser.add_argument("--streams", type=int, default=32, help="throughput streams (default: 32)")
    parser.add_argument("--output-tokens", type=int, default=64, help="throughput output tokens (default: 64)")
    parser.add_argument("--front-streams", type=int, default=64, help="front overhead streams (default: 64)")
    shape = ConversationShape()
    for name in ("users", "turns", "system_words", "user_words", "answer_tokens"):
        field_name = {"users": "num_users", "turns": "num_turns"}.get(name, name)
        default = getattr(shape, field_name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=f"(default: {default})")
    parser.add_argument("--think-seconds", type=float, default=shape.think_seconds,
                        help="a user's mean pause between an answer and the next turn (default: 0, a closed loop)")
    parser.add_argument("--server-args", default="", help="more flags for every server, e.g. '--dtype float32'")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=servers.REPO_ROOT / "bench" / "results" / "cluster.json")
    args = parser.parse_args(argv)
    results = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
