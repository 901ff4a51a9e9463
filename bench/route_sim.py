"""`python -m bench route-sim`: the replica router's own code (web/cluster/router.py) on a synthetic trace of
thousands of conversations, for 2 to 64 replicas and each policy: prefix-hit rate and load spread, on paper.

The trace: conversations arrive at random over `--horizon` seconds, each picks one of a few system prompts
(a few are popular), then alternates user turns and answers with a think time between. Every replica keeps
an LRU prefix cache of `--kv-blocks` blocks (its KV pool; a request's blocks are touched tail first, as the
block manager frees tail blocks first) and serves a turn in prefill time (uncached tokens) plus decode time.
A turn's hits are the leading blocks of its prompt found in its replica's cache; its load is the replica's
requests in flight, which is what the router sees. Load spread: the busiest replica's work over the mean.
The offered load grows with the replicas (`--conversations-per-replica`), so each replica is as busy at 64 as
at 2, and the pool of conversations (and system prompts) outgrows any one replica's cache.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from web.cluster.router import BALANCE_ABS, BALANCE_REL, MIN_MATCH_SHARE, Router, prompt_block_hashes

POLICIES = ("affine", "round_robin", "least_loaded")
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Turn:
    conversation: int
    index: int
    num_prompt_blocks: int  # full blocks of this turn's prompt
    num_cached_after: int  # full blocks of prompt + answer, which the replica holds afterwards
    num_prompt_tokens: int
    num_answer_tokens: int


@dataclass(frozen=True)
class Conversation:
    start: float
    hashes: list[int]  # every full block of the whole conversation, chained
    turns: list[Turn]
    think_times: list[float]


def make_trace(num_conversations: int, horizon: float, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    systems = [[rng.randrange(50_000) for _ in range(rng.randint(200, 800))] for _ in range(8)]
    popularity = [1 / (rank + 1) for rank in range(len(systems))]  # Zipf: a few system prompts dominate
    trace = []
    for c in range(num_conversations):
        tokens = list(rng.choices(systems, popularity)[0])
        turns = []
        for t in range(rng.randint(2, 8)):
            tokens += [rng.randrange(50_000) for _ in range(rng.randint(20, 200))]
            num_prompt = len(tokens)
            answer = rng.randint(20, 300)
            tokens += [rng.randrange(50_000) for _ in range(answer)]
            turns.append(Turn(c, t, num_prompt // BLOCK_SIZE, len(tokens) // BLOCK_SIZE, num_prompt, answer))
        hashes = prompt_block_hashes(tokens, BLOCK_SIZE)
        think = [rng.expovariate(1 / 20.0) for _ in turns]
        trace.append(Conversation(rng.uniform(0, horizon), hashes, turns, think))
    return trace


class ReplicaCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def serve(self, hashes: list[int], num_prompt_blocks: int, num_cached_after: int) -> int:
        """Leading prompt blocks found; then the prompt and answer blocks are held (tail first, head newest)."""
        hits = 0
        while hits < num_prompt_blocks and hashes[hits] in self.blocks:
            hits += 1
        for block_hash in reversed(hashes[:num_cached_after]):
            self.blocks[block_hash] = None
            self.blocks.move_to_end(block_hash)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return hits


def simulate(trace: list[Conversation], num_replicas: int, policy: str, kv_blocks: int,
             prefill_tok_s: float, decode_tok_s: float, **thresholds: float) -> dict[str, float]:  # fmt: skip
    router = Router(policy, num_replicas, memory_blocks=kv_blocks * num_replicas, **thresholds)  # type: ignore[arg-type]
    caches = [ReplicaCache(kv_blocks) for _ in range(num_replicas)]
    in_flight = [0] * num_replicas
    work = [0.0] * num_replicas
    events: list[tuple[float, int, int, int, int]] = []  # (time, kind 0=end 1=arrival, conversation, turn, replica)
    for c, conversation in enumerate(trace):
        heapq.heappush(events, (conversation.start, 1, c, 0, -1))
    num_hit_tokens = num_prompt_tokens = 0
    while events:
        now, kind, c, t, replica = heapq.heappop(events)
        conversation = trace[c]
        if kind == 0:
            in_flight[replica] -= 1
            if t + 1 < len(conversation.turns):
                heapq.heappush(events, (now + conversation.think_times[t], 1, c, t + 1, -1))
            continue
        turn = conversation.turns[t]
        prompt_hashes = conversation.hashes[: turn.num_prompt_blocks]
        route = router.choose(prompt_hashes, dict(enumerate(in_flight)))
        assert route is not None
        replica = route.replica
        hits = caches[replica].serve(conversation.hashes, turn.num_prompt_blocks, turn.num_cached_after)
        num_hit_tokens += hits * BLOCK_SIZE
        num_prompt_tokens += turn.num_prompt_tokens
        seconds = (turn.num_prompt_tokens - hits * BLOCK_SIZE) / prefill_tok_s + turn.num_answer_tokens / decode_tok_s
        work[replica] += seconds
        in_flight[replica] += 1
        heapq.heappush(events, (now + seconds, 0, c, t, replica))
    mean_work = sum(work) / num_replicas
    return {
        "hit_rate": num_hit_tokens / num_prompt_tokens,
        "load_spread": max(work) / mean_work if mean_work else 1.0,
        "decisions": dict(router.decisions),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="2,4,8,16,32,64")
    parser.add_argument("--conversations-per-replica", type=int, default=100)
    parser.add_argument("--horizon-per-conversation", type=float, default=1.0, help="seconds of arrivals each")
    parser.add_argument("--kv-blocks", type=int, default=2048, help="each replica's KV pool (default: 2048 x 16)")
    parser.add_argument("--prefill-tok-s", type=float, default=2000.0)
    parser.add_argument("--decode-tok-s", type=float, default=20.0, help="one stream's decode rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--balance-abs", type=int, default=BALANCE_ABS, help="the router's threshold to try")
    parser.add_argument("--balance-rel", type=float, default=BALANCE_REL)
    parser.add_argument("--min-match-share", type=float, default=MIN_MATCH_SHARE)
    parser.add_argument("--out", type=Path, default=Path("bench/results/route_sim.json"))
    parser.add_argument("--plot", type=Path, default=Path("bench/results/route_sim.png"))
    args = parser.parse_args(argv)
    results: dict[str, dict[str, dict]] = {p: {} for p in POLICIES}
    for n in (int(x) for x in args.replicas.split(",")):
        num_conversations = args.conversations_per_replica * n
        trace = make_trace(num_conversations, num_conversations * args.horizon_per_conversation, args.seed)
        for policy in POLICIES:
            result = simulate(trace, n, policy, args.kv_blocks, args.prefill_tok_s, args.decode_tok_s,
                              balance_abs=args.balance_abs, balance_rel=args.balance_rel,
                              min_match_share=args.min_match_share)  # fmt: skip
            results[policy][str(n)] = result
            print(f"{n:3d} replicas {num_conversations:5d} conversations  {policy:12s}  hit rate "
                  f"{result['hit_rate']:.3f}  load spread {result['load_spread']:.2f}", file=sys.stderr)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    plot(results, args.plot)
    return 0


def plot(results: dict[str, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hits, spread) = plt.subplots(1, 2, figsize=(8, 3.2), dpi=80)
    for policy, by_n in results.items():
        ns = [int(n) for n in by_n]
        hits.plot(ns, [by_n[str(n)]["hit_rate"] for n in ns], marker="o", label=policy)
        spread.plot(ns, [by_n[str(n)]["load_spread"] for n in ns], marker="o", label=policy)
    for ax, title in ((hits, "prefix-hit rate"), (spread, "busiest replica's work / mean")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    hits.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
