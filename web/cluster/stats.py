"""What replicas report and what the front's /health and /metrics show of them (no Ray here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.async_engine import EngineStats
from engine.speculative.stats import ProposerCounts


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """One replica's own counters, as it reports them."""

    pid: int
    state: str
    running: int
    waiting: int
    pending: int
    free_kv_blocks: int
    total_kv_blocks: int
    num_prefix_queries: int  # prompt tokens looked up in its prefix cache
    num_prefix_hits: int  # of which found
    num_preemptions: int = 0
    speculation: dict[str, ProposerCounts] = field(default_factory=dict)  # proposer -> its counters

    @property
    def load(self) -> int:
        return self.running + self.waiting + self.pending

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0


@dataclass(frozen=True, slots=True)
class ClusterStats(EngineStats):
    """The replicas summed (state: ready while one replica is), with each replica and the routing decisions."""

    num_ready: int = 0
    routing: str = ""
    decisions: dict[str, int] = field(default_factory=dict)
    replicas: list[dict[str, Any]] = field(default_factory=list)

    def replicas_body(self) -> dict[str, Any]:
        """The `replicas` object of /health."""
        return {
            "ready": self.num_ready,
            "total": len(self.replicas),
            "routing": self.routing,
            "decisions": self.decisions,
            "replicas": self.replicas,
        }
