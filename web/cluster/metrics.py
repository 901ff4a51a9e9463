"""The front's /metrics with replicas: the sums stay in ServerMetrics' series; these add each replica (labelled
by its slot) and the router's decisions by reason."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from web.cluster.stats import ClusterStats


class ClusterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.ready = Gauge("sluice_replicas_ready", "Replicas taking requests", registry=r)
        self.load = Gauge("sluice_replica_load", "A replica's running + waiting + queued requests", ["replica"], registry=r)
        self.in_flight = Gauge("sluice_replica_in_flight", "Requests this front has in flight on a replica",
                               ["replica"], registry=r)  # fmt: skip
        self.hit_rate = Gauge("sluice_replica_prefix_cache_hit_rate", "A replica's prefix-cache hit rate",
                              ["replica"], registry=r)  # fmt: skip
        self.restarts = Gauge("sluice_replica_restarts", "Times a replica's process was replaced", ["replica"], registry=r)
        self.decisions = Counter("sluice_routing_decisions", "Requests routed, by the reason of the choice",
                                 ["reason"], registry=r)  # fmt: skip
        self._counted: dict[str, int] = {}

    def update(self, stats: ClusterStats) -> None:
        self.ready.set(stats.num_ready)
        for replica in stats.replicas:
            label = str(replica["index"])
            self.load.labels(label).set(replica.get("load", 0))
            self.in_flight.labels(label).set(replica["in_flight"])
            self.hit_rate.labels(label).set(replica.get("prefix_cache_hit_rate", 0.0))
            self.restarts.labels(label).set(replica["restarts"])
        for reason, count in stats.decisions.items():
            self.decisions.labels(reason).inc(count - self._counted.get(reason, 0))
            self._counted[reason] = count
