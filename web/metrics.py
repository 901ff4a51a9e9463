"""Prometheus metrics, in a registry per app (tests build several apps in one process)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from engine.async_engine import EngineStats
from engine.request import Request
from engine.outputs import FinishReason, RequestOutput
from engine.speculative.stats import ProposerCounts
from web.cluster.metrics import ClusterMetrics
from web.cluster.stats import ClusterStats

# Fine below 1 ms: the admission decision is meant to take well under a millisecond.
ADMISSION_BUCKETS = (
    0.00005, 0.0001, 0.0002, 0.0003, 0.0004, 0.0005, 0.00075, 0.001,
    0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)


class ServerMetrics:
    def __init__(self) -> None:
        disable_created_metrics()  # the *_created series only add noise to every scrape
        self.registry = r = CollectorRegistry()

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"sluice_{name}_seconds", doc, buckets=buckets, registry=r)

        self.admission = histogram(
            "admission", "Request body received to the enqueue or 429 decision", ADMISSION_BUCKETS
        )
        self.body_wait = histogram("body_wait", "Handler entry to the whole request body received", ADMISSION_BUCKETS)
        self.ttft = histogram("time_to_first_token", "Accepted to the first token", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency", "Time between tokens", LATENCY_BUCKETS)
        self.queue = histogram("queue_time", "Accepted to handed to the scheduler", LATENCY_BUCKETS)
        self.e2e = histogram("e2e_latency", "Accepted to the terminal event", E2E_BUCKETS)
        self.running = Gauge("sluice_requests_running", "Sequences in the running batch (a request's n choices: n)",
                             registry=r)  # fmt: skip
        self.waiting = Gauge("sluice_requests_waiting", "Sequences waiting in the scheduler (a request's n choices: n)",
                             registry=r)  # fmt: skip
        self.pending = Gauge("sluice_requests_pending", "Requests in the admission queue", registry=r)
        self.free_blocks = Gauge("sluice_kv_blocks_free", "Free KV-cache blocks", registry=r)
        self.total_blocks = Gauge("sluice_kv_pool_blocks", "KV-cache blocks in the pool", registry=r)
        self.kv_usage = Gauge("sluice_kv_cache_usage_ratio", "Share of the KV-cache blocks in use (0-1)", registry=r)
        self.hit_rate = Gauge("sluice_prefix_cache_hit_rate", "Prefix-cache hit rate since start", registry=r)
        self.rejected = Counter("sluice_requests_rejected", "Requests answered 429 (admission queue full)", registry=r)
        self.aborted = Counter("sluice_requests_aborted", "Requests ended by abort (disconnect or drain)", registry=r)
        self.failed = Counter("sluice_requests_failed", "Requests ended by an engine error", registry=r)
        self.finished = Counter("sluice_requests_finished", "Requests ended by stop or length (or by "
                                "an error of their own input), by the last choice's reason", ["finished_reason"],
                                registry=r)  # fmt: skip
        self.responses = Counter("sluice_http_responses", "Responses of the API by status code (every 4xx and 5xx "
                                 "with them)", ["status"], registry=r)  # fmt: skip
        self.prompt_tokens = Counter("sluice_prompt_tokens", "Prompt tokens of the requests that ended", registry=r)
        self.generation_tokens = Counter("sluice_generation_tokens", "Tokens generated (all choices), counted as "
                                         "they reach the handler", registry=r)  # fmt: skip
        self.speculation = SpeculationCollector()
        r.register(self.speculation)
        self.preemptions = ScrapedCounter("sluice_preemptions", "Sequences preempted for KV blocks (recomputed later)")
        self.prefix_queries = ScrapedCounter("sluice_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                             "cache")  # fmt: skip
        self.prefix_hits = ScrapedCounter("sluice_prefix_cache_hits", "Prompt tokens found in the prefix cache")
        for collector in (self.preemptions, self.prefix_queries, self.prefix_hits):
            r.register(collector)
        self._cluster: ClusterMetrics | None = None  # with --replicas: the replicas one by one

    def render(self, stats: EngineStats) -> bytes:
        if isinstance(stats, ClusterStats):
            if self._cluster is None:
                self._cluster = ClusterMetrics(self.registry)
            self._cluster.update(stats)
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.pending.set(stats.pending)
        self.free_blocks.set(stats.free_kv_blocks)
        self.total_blocks.set(stats.total_kv_blocks)
        used = stats.total_kv_blocks - stats.free_kv_blocks
        self.kv_usage.set(used / stats.total_kv_blocks if stats.total_kv_blocks else 0.0)
        self.hit_rate.set(stats.prefix_cache_hit_rate)
        self.speculation.counts = stats.speculation or {}
        self.preemptions.value = stats.num_preemptions
        self.prefix_queries.value = stats.num_prefix_queries
        self.prefix_hits.value = stats.num_prefix_hits
        return generate_latest(self.registry)


class ScrapedCounter:
    """A counter the engine keeps, read at each scrape (prometheus_client's Counter only counts up itself)."""

    def __init__(self, name: str, doc: str) -> None:
        self.name, self.doc, self.value = name, doc, 0

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.doc, value=self.value)


class SpeculationCollector:
    """The engine's speculation counters by proposer, read at each scrape (tokens per step = emitted / steps)."""

    SERIES = (
        ("steps", "num_steps", "Verification steps (a sequence's last token and its drafts in one query)"),
        ("draft_tokens", "num_draft_tokens", "Draft tokens proposed"),
        ("accepted_tokens", "num_accepted_tokens", "Draft tokens accepted"),
        ("emitted_tokens", "num_emitted_tokens", "Tokens emitted by verification steps (accepted drafts + 1 each)"),
    )

    def __init__(self) -> None:
        self.counts: Mapping[str, ProposerCounts] = {}

    def collect(self) -> Iterator[Metric]:
        for name, attribute, doc in self.SERIES:
            family = CounterMetricFamily(f"sluice_speculative_{name}", doc, labels=["proposer"])
            for proposer, counts in self.counts.items():
                family.add_metric([proposer], getattr(counts, attribute))
            yield family


class RequestTimer:
    """Observes one request's latencies as the handler sees its deltas: the time to its first token, and between
    the tokens of each choice (n choices' deltas of one step are not gaps)."""

    def __init__(self, metrics: ServerMetrics, request: Request) -> None:
        self._metrics = metrics
        self._request = request
        self._last_token_times: dict[int, float] = {}  # per choice index
        self._num_tokens_counted = 0
        self._num_open = request.num_choices  # the request ends with its last choice
        self.ended = False

    def observe(self, output: RequestOutput) -> None:
        if output.new_token_ids:
            now = time.perf_counter()
            last = self._last_token_times.get(output.index)
            if not self._last_token_times:
                self._metrics.ttft.observe(now - self._request.arrival_time)
                if self._request.admitted_time is not None:
                    self._metrics.queue.observe(self._request.admitted_time - self._request.arrival_time)
            elif last is not None:
                self._metrics.itl.observe(now - last)
            self._last_token_times[output.index] = now
            self._metrics.generation_tokens.inc(len(output.new_token_ids))
            self._num_tokens_counted += len(output.new_token_ids)
        if output.finished:
            self._num_open -= 1
            if not self._num_open or output.finish_reason is FinishReason.ERROR:
                self.end(output.finish_reason or FinishReason.ABORT, is_request_error=output.error_code is not None)

    def end(self, finish_reason: FinishReason, is_request_error: bool = False) -> None:
        """is_request_error: an ERROR the request's own input caused (a 400), counted as finished "error", not as
        an engine failure."""
        if self.ended:
            return
        self.ended = True
        self._metrics.e2e.observe(time.perf_counter() - self._request.arrival_time)
        metrics = self._metrics
        if finish_reason is FinishReason.ABORT:
            metrics.aborted.inc()
        elif finish_reason is FinishReason.ERROR and not is_request_error:
            metrics.failed.inc()
        else:
            metrics.finished.labels(finish_reason.value).inc()
        metrics.prompt_tokens.inc(self._request.num_prompt_tokens)
        # tokens made but never seen here (the client left before reading them)
        metrics.generation_tokens.inc(max(0, self._request.num_output_tokens - self._num_tokens_counted))
