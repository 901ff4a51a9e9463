"""Which replica a request goes to: cache-affine (by the block manager's own prefix hashes), round robin or
least loaded. Pure Python with no Ray in it, so that bench/route_sim.py runs this very code on a synthetic trace.

Why a router in the front rather than a Ray Serve custom request router: the front already holds the prompt's
token ids (it runs the input processor), so it hashes the blocks with engine.block_manager.hash_block at the
engine's own block boundaries, for free; each replica is a deployment of its own, so a replica's identity (and
its prefix memory) is a stable slot that survives Ray restarting the process behind it, and a stream that dies
is known to be that replica's; and the same decision code runs in the simulation without Ray. (Ray Serve's
request-router API is marked alpha and sees only the call's arguments.) What is given up: Ray Serve's own
autoscaling of one deployment; the number of replicas is the number of slots.

How it decides, after SGLang's cache-aware router and Ray Serve LLM's PrefixCacheAffinityRouter:
- Both remember which worker recently received which prefix (SGLang: an approximate radix tree per worker;
  Ray: a prefix tree of text) and evict by age. Here the chained hashes make the tree a flat map: a block's hash
  covers every token before it, so the longest remembered hash of the prompt is its longest remembered prefix,
  found by walking the prompt's hashes backwards. Each hash remembers every replica that got it (a bit mask),
  so a system prompt that all replicas hold leaves the choice to load, while a conversation's own history
  points at the one replica that has it.
- A match counts when it covers a meaningful share of the prompt's full blocks (SGLang's cache_threshold,
  Ray's match_rate_threshold): otherwise the least loaded replica gets the request (and its prefix).
- Load beats affinity only when the imbalance is large both absolutely and relatively (SGLang's abs and rel
  balance thresholds; Ray uses an absolute queue-length gap). Unlike SGLang, which looks at the global max and
  min, the gap here is between the replica affinity picked and the least loaded one: only the load of the
  replica that would take the request matters.
- Load is per replica: what the replica itself last reported (running + waiting + queued), or what this
  front has in flight there when that is more (it knows of requests sent since the last report).
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.block_manager import hash_block

# A prefix counts when it covers at least this share of the prompt's full blocks (SGLang's cache_threshold
# default is 0.5, Ray's 0.1). A conversation's next turn matches 80-99% of its blocks; a shared system prompt
# alone under a long history matches less, and then load decides.
MIN_MATCH_SHARE = 0.5
# Load beats affinity when the affine replica carries more than this many requests over the least loaded one
# AND more than this ratio of its load. A decode step's cost grows slowly with the batch, while a prefix hit
# saves the prefill of hundreds of tokens, so the gap has to be real; but a popular system prompt draws every
# new conversation to its holders, and with many lightly loaded replicas a large absolute gap is never
# crossed: bench.route_sim at 32 replicas, abs 8: hit rate 0.912, busiest replica 2.60x the mean work; abs 4:
# 0.910 and 1.45x; abs 2: 0.881 and 1.10x (8 replicas: abs 4 gives 0.879 and 1.03x).
BALANCE_ABS = 4
BALANCE_REL = 1.5


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the prompt's full blocks, exactly as the block manager computes them."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, list(token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


class PrefixMemory:
    """Block hash -> bit mask of the replicas that recently received it; bounded, least recently used evicted."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._owners: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def longest_match(self, hashes: Sequence[int]) -> tuple[int, int]:
        """(number of leading blocks matched, mask of the replicas that got that prefix); (0, 0) if none."""
        owners = self._owners
        for i in range(len(hashes) - 1, -1, -1):
            mask = owners.get(hashes[i])
            if mask:
                return i + 1, mask
        return 0, 0

    def record(self, hashes: Sequence[int], replica: int) -> None:
        bit = 1 << replica
        owners = self._owners
        # Tail first, so that a prompt's first blocks are the most recent: the tail is evicted before the head,
        # as the block manager frees (and reuses) tail blocks first, and a remembered hash always has its parents.
        for block_hash in reversed(hashes):
            owners[block_hash] = owners.get(block_hash, 0) | bit
            owners.move_to_end(block_hash)
        while len(owners) > self.capacity:
            owners.popitem(last=False)

    def forget(self, replica: int) -> None:
        """A replica restarted with an empty cache: nothing points at it any more."""
        keep = ~(1 << replica)
        for block_hash in list(self._owners):
            mask = self._owners[block_hash] & keep
            if mask:
                self._owners[block_hash] = mask
            else:
                del self._owners[block_hash]


@dataclass(frozen=True, slots=True)
class Route:
    replica: int
    reason: str  # "prefix", "load" (affinity overruled), "least_loaded", "round_robin"
    num_matched_blocks: int = 0


class Router:
    def __init__(
        self,
        policy: str,
        num_replicas: int,
        memory_blocks: int,
        *,
        min_match_share: float = MIN_MATCH_SHARE,
        balance_abs: int = BALANCE_ABS,
        balance_rel: float = BALANCE_REL,
    ) -> None:
        if policy not in ("affine", "round_robin", "least_loaded"):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy = policy
        self.num_replicas = num_replicas
        self.memory = PrefixMemory(memory_blocks)
        self.min_match_share = min_match_share
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.decisions: Counter[str] = Counter()
        self._turn = itertools.count()  # round robin, and who wins a tie of loads

    def choose(self, block_hashes: Sequence[int], loads: dict[int, int]) -> Route | None:
        """loads: replica -> its load, for the replicas that can take a request now. None if there are none."""
        if not loads:
            return None
        route = self._choose(block_hashes, loads)
        self.decisions[route.reason] += 1
        if self.policy == "affine":
            self.memory.record(block_hashes, route.replica)
        return route

    def _choose(self, block_hashes: Sequence[int], loads: dict[int, int]) -> Route:
        candidates = sorted(loads)
        turn = next(self._turn)
        if self.policy == "round_robin":
            return Route(candidates[turn % len(candidates)], "round_robin")
        least = self._least_loaded(candidates, loads, turn)
        if self.policy == "least_loaded" or not block_hashes:
            return Route(least, "least_loaded")
        num_matched, mask = self.memory.longest_match(block_hashes)
        holders = [r for r in candidates if mask >> r & 1]
        if not holders or num_matched < self.min_match_share * len(block_hashes):
            return Route(least, "least_loaded", num_matched)
        affine = self._least_loaded(holders, loads, turn)
        gap = loads[affine] - loads[least]
        if gap > self.balance_abs and loads[affine] > self.balance_rel * loads[least]:
            return Route(least, "load", num_matched)
        return Route(affine, "prefix", num_matched)

    @staticmethod
    def _least_loaded(candidates: list[int], loads: dict[int, int], turn: int) -> int:
        # Ties rotate with the turn, so that equal replicas share a burst instead of the first taking it all.
        n = len(candidates)
        return min((candidates[(turn + k) % n] for k in range(n)), key=loads.__getitem__)
