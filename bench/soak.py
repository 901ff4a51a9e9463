"""`python -m bench --soak`: a long mixed load (streams, non-streams, disconnects, never-read sockets, bad
input), then the server's RSS, file descriptors and threads at rest compared with their start values.

Stages: warm-up (enough concurrent long requests to cycle through every KV block, so the pool's pages are
resident before the start figure) -> rest, start figures -> soak for `duration` -> rest, end figures.
The request loops stop issuing at the deadline; every request is bounded by a timeout (a never-read client
by its hold time), so the run ends by itself.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from bench import growth, health_probe, hostile
from bench.bad_input import BadRequest, catalogue
from bench.client import RequestOptions, Target
from bench.health_probe import HealthSample
from bench.proc import ProcessSample, read_process
from bench.report import format_rows
from bench.runner import LoadShape, make_client, run_level
from bench.stats import summarize
from bench.workload import LengthDist, RequestSpec, build_workload

KIND_WEIGHTS = {"stream": 30, "non-stream": 15, "disconnect": 15, "never-read": 5, "bad": 35}
PROCESS_SAMPLE_SECONDS = 1.0
MIN_REST_SECONDS = 2.0


@dataclass(frozen=True)
class SoakConfig:
    duration: float = 600.0
    concurrency: int = 8
    endpoint: str = "chat"
    warmup_concurrency: int = 32
    warmup_prompt_tokens: int = 896
    warmup_output_tokens: int = 128
    warmup_max_seconds: float = 600.0
    prompt_tokens: LengthDist = LengthDist("uniform", 8, 256)
    output_tokens: LengthDist = LengthDist("uniform", 4, 64)
    long_output_tokens: int = 1024  # for clients that disconnect or never read: they must not end first
    block_size: int = 16  # Sluice's default: tokens per KV block, to size the warm-up from /health's block count
    max_never_read: int = 4  # never-read sockets open at once
    never_read_seconds: float = 20.0
    request_timeout: float = 120.0
    health_interval: float = 0.25
    settle_seconds: float = 30.0  # longest wait at rest for the figures to come back (pool threads expire)
    checkpoints: int = 3  # rests during the soak (the last one gives the end figures): a leak rises at each
    rss_floor_bytes: int = growth.RSS_FLOOR_BYTES
    seed: int = 0


@dataclass
class SoakResult:
    url: str
    pid: int | None
    config: SoakConfig
    warmup: dict[str, Any] = field(default_factory=dict)
    soak_seconds: float = 0.0
    start: ProcessSample | None = None
    end: ProcessSample | None = None
    start_health: HealthSample | None = None
    end_health: HealthSample | None = None
    samples: list[ProcessSample] = field(default_factory=list)  # during the soak
    priming: list[hostile.Outcome] = field(default_factory=list)  # before the start figures, not counted below
    checkpoints: list[tuple[float, ProcessSample | None]] = field(default_factory=list)  # (s into the soak, at rest)
    outcomes: list[hostile.Outcome] = field(default_factory=list)
    health: list[HealthSample] = field(default_factory=list)  # during the soak
    server_died: bool = False

    @property
    def verdicts(self) -> list[growth.Growth]:
        if self.start is None or self.end is None:
            return []
        return growth.judge(self.start, self.end, self.config.rss_floor_bytes)

    @property
    def kv_blocks_leaked(self) -> int | None:
        """Blocks not free at rest at the end (every block is free, cached or not, when nothing runs)."""
        body = (self.end_health.body or {}) if self.end_health else {}
        if "free_kv_blocks" not in body or "total_kv_blocks" not in body:
            return None
        return body["total_kv_blocks"] - body["free_kv_blocks"]

    @property
    def is_clean(self) -> bool:
        return (not self.server_died and not growth.has_grown(self.verdicts) and not self.kv_blocks_leaked
                and (self.end_health is None or health_probe.is_idle(self.end_health)))

    def summary(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "pid": self.pid,
            "config": asdict(self.config),
            "warmup": self.warmup,
            "priming": _counts(self.priming),
            "soak_seconds": self.soak_seconds,
            "sent": len(self.outcomes),
            "outcomes": _counts(self.outcomes),
            "failure_samples": sorted({f"{o.kind}: {o.detail}" for o in self.outcomes
                                       if o.outcome in hostile.FAILURES | {"unexpected"}})[:10],
            "start": asdict(self.start) if self.start else None,
            "end": asdict(self.end) if self.end else None,
            "peak": _peak(self.samples),
            "checkpoints": [{"seconds": t, **(asdict(p) if p else {})} for t, p in self.checkpoints],
            "verdicts": [{**asdict(v), "delta": v.delta, "is_growth": v.is_growth} for v in self.verdicts],
            "start_health": self.start_health.body if self.start_health else None,
            "end_health": self.end_health.body if self.end_health else None,
            "kv_blocks_leaked": self.kv_blocks_leaked,
            "health_s": summarize(health_probe.latencies(self.health)),
            "health_failed": health_probe.num_failed(self.health),
            "server_died": self.server_died,
            "is_clean": self.is_clean,
        }


def _counts(outcomes: list[hostile.Outcome]) -> dict[str, dict[str, int]]:
    table: dict[str, Counter] = {}
    for o in outcomes:
        table.setdefault(o.kind, Counter())[o.outcome] += 1
    return {kind: dict(counter) for kind, counter in sorted(table.items())}


def _peak(samples: list[ProcessSample]) -> dict[str, int] | None:
    if not samples:
        return None
    return {key: max(getattr(s, key) for s in samples) for key in ("rss_bytes", "num_fds", "num_threads")}


async def warm_kv_pool(target: Target, config: SoakConfig, options: RequestOptions) -> dict[str, Any]:
    """Distinct long prompts, `warmup_concurrency` at a time, until as many tokens as the KV pool holds went by."""
    async with make_client(1) as health_client:
        first = await health_probe.probe(health_client, target.root)
        total_blocks = (first.body or {}).get("total_kv_blocks")
        per_request = config.warmup_prompt_tokens + config.warmup_output_tokens
        pool_tokens = total_blocks * config.block_size if total_blocks else None
        num_requests = math.ceil(pool_tokens / per_request) if pool_tokens else 2 * config.warmup_concurrency
        num_requests = max(num_requests, config.warmup_concurrency)
        specs = build_workload(num_requests, LengthDist("fixed", config.warmup_prompt_tokens),
                               LengthDist("fixed", config.warmup_output_tokens), config.seed + 104729)
        seen: list[HealthSample] = []
        sampler = asyncio.create_task(health_probe.sample_until_cancelled(health_client, target.root, 0.5, seen))
        try:
            shape = LoadShape("closed", config.warmup_concurrency, config.warmup_max_seconds)
            level = await run_level(target, specs, shape, options, health_interval=None)
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
    summary = level.summary()
    free = [s.body["free_kv_blocks"] for s in seen if s.body and "free_kv_blocks" in s.body]
    return {
        "requests": summary["sent"], "completed": summary["completed"], "errors": summary["errors"],
        "tokens": summary["prompt_tokens"] + summary["completion_tokens"], "pool_tokens": pool_tokens,
        "total_kv_blocks": total_blocks, "min_free_kv_blocks": min(free, default=None), "seconds": level.duration,
        "error_samples": summary["error_samples"],
    }


async def rest(root: str, pid: int | None, baseline: ProcessSample | None, settle: float
               ) -> tuple[ProcessSample | None, HealthSample]:
    """Waits until nothing runs, then (up to `settle` s) until fds and threads are back to the baseline."""
    deadline = time.monotonic() + settle
    async with make_client(1) as client:
        idle_since = None
        while True:
            health = await health_probe.probe(client, root)
            now = time.monotonic()
            idle_since = (idle_since or now) if health_probe.is_idle(health) else None
            try:
                sample = read_process(pid) if pid is not None else None
            except (OSError, ValueError):
                return None, health  # the server is gone
            is_rested = idle_since is not None and now - idle_since >= MIN_REST_SECONDS
            is_back = baseline is None or sample is None or (
                sample.num_fds <= baseline.num_fds and sample.num_threads <= baseline.num_threads)
            if (is_rested and is_back) or now >= deadline:
                return sample, health
            await asyncio.sleep(0.5)


class SoakClients:
    """Workers that pick a behaviour at random (seeded) until the deadline."""

    def __init__(self, target: Target, config: SoakConfig, options: RequestOptions) -> None:
        self.target = target
        self.config = config
        self.options = options
        self.host, self.port = hostile.require_loopback(target.root)
        self.specs = build_workload(512, config.prompt_tokens, config.output_tokens, config.seed)
        self.long_specs = build_workload(64, config.prompt_tokens, LengthDist("fixed", config.long_output_tokens),
                                         config.seed + 1)
        bad = catalogue(target.model or "", config.seed)
        self.bad = bad
        self.bad_weights = [1 if b.is_heavy else 4 for b in bad]
        self.never_read_slots = asyncio.Semaphore(config.max_never_read)

    async def run(self, deadline: float, segment: int, out: list[hostile.Outcome]) -> None:
        async with make_client(self.config.concurrency) as client:
            rngs = [random.Random(f"{self.config.seed}/{segment}/{i}") for i in range(self.config.concurrency)]
            await asyncio.gather(*(self._worker(client, rng, deadline, out) for rng in rngs))

    async def prime(self, out: list[hostile.Outcome]) -> None:
        """Every kind of request, `concurrency` at once (never-read: as many as the soak holds open): the
        allocator's high-water marks (a megabyte prompt tokenized 8 times at once) are reached before the start
        figure, so what the soak adds is accumulation, not a first peak."""
        n = self.config.concurrency
        rng = random.Random(self.config.seed)
        async with make_client(n) as client:
            timeout = self.config.request_timeout
            for bad in self.bad:
                out += await asyncio.gather(*(hostile.send_bad(client, self.target.root, bad, timeout) for _ in range(n)))
            for kind in ("stream", "non-stream", "disconnect"):
                out += await asyncio.gather(*(self._one(client, kind, rng, math.inf) for _ in range(n)))
            out += await asyncio.gather(*(self._one(client, "never-read", rng, math.inf)
                                          for _ in range(self.config.max_never_read)))

    async def _worker(self, client: httpx.AsyncClient, rng: random.Random, deadline: float,
                      out: list[hostile.Outcome]) -> None:
        kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            out.append(await self._one(client, kind, rng, deadline))

    async def _one(self, client: httpx.AsyncClient, kind: str, rng: random.Random, deadline: float) -> hostile.Outcome:
        spec: RequestSpec = rng.choice(self.specs)
        if kind == "never-read" and not self.never_read_slots.locked():
            async with self.never_read_slots:
                hold = min(self.config.never_read_seconds, max(1.0, deadline - time.monotonic()))
                return await hostile.never_read(self.host, self.port, self.target, rng.choice(self.long_specs),
                                                self.options, hold)
        if kind == "bad":
            bad: BadRequest = rng.choices(self.bad, self.bad_weights)[0]
            return await hostile.send_bad(client, self.target.root, bad, self.config.request_timeout)
        if kind == "non-stream":
            return await hostile.non_stream(client, self.target, spec, self.options)
        if kind == "disconnect":
            return await hostile.disconnect_mid_stream(client, self.target, rng.choice(self.long_specs), self.options,
                                                       rng.randint(1, 8))
        return await hostile.stream_full(client, self.target, spec, self.options)


async def _watch_process(pid: int, out: list[ProcessSample], died: asyncio.Event) -> None:
    while True:
        try:
            out.append(read_process(pid))
        except (OSError, ValueError):
            died.set()
            return
        await asyncio.sleep(PROCESS_SAMPLE_SECONDS)


async def run_soak(target: Target, pid: int | None, config: SoakConfig, log=print) -> SoakResult:
    hostile.require_loopback(target.root)
    options = RequestOptions(config.endpoint, 0.0, True, True, config.request_timeout)
    result = SoakResult(target.root, pid, config)
    log(f"soak: warm-up, {config.warmup_concurrency} streams of {config.warmup_prompt_tokens}+"
        f"{config.warmup_output_tokens} tokens")
    result.warmup = await warm_kv_pool(target, config, options)
    clients = SoakClients(target, config, options)
    log(f"soak: warm-up done in {result.warmup['seconds']:.0f} s; priming: every kind of request, "
        f"{config.concurrency} at once")
    await clients.prime(result.priming)
    log("soak: resting")
    result.start, result.start_health = await rest(target.root, pid, None, config.settle_seconds)
    started = time.monotonic()
    for segment in range(max(1, config.checkpoints)):
        until = started + config.duration * (segment + 1) / max(1, config.checkpoints)
        log(f"soak: mixed load, {config.concurrency} clients, until {until - started:.0f} s")
        result.server_died = await _soak_segment(target, pid, config, clients, segment, until, result)
        result.soak_seconds = time.monotonic() - started
        if result.server_died:
            break
        log("soak: resting")
        result.end, result.end_health = await rest(target.root, pid, result.start, config.settle_seconds)
        result.checkpoints.append((result.soak_seconds, result.end))
        if pid is not None and result.end is None:
            result.server_died = True
            break
    return result


async def _soak_segment(target: Target, pid: int | None, config: SoakConfig, clients: SoakClients, segment: int,
                        until: float, result: SoakResult) -> bool:
    """Mixed load until `until`, with /health and /proc sampled; True when the server died meanwhile."""
    died = asyncio.Event()
    async with make_client(1) as health_client:
        watchers = [asyncio.create_task(
            health_probe.sample_until_cancelled(health_client, target.root, config.health_interval, result.health))]
        if pid is not None:
            watchers.append(asyncio.create_task(_watch_process(pid, result.samples, died)))
        load = asyncio.create_task(clients.run(until, segment, result.outcomes))
        death = asyncio.create_task(died.wait())
        try:
            await asyncio.wait({load, death}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (load, death, *watchers):
                task.cancel()
            await asyncio.gather(load, death, *watchers, return_exceptions=True)
    return died.is_set()


def report(result: SoakResult) -> str:
    s = result.summary()
    warm = s["warmup"]
    lines = [
        f"soak of {result.url} (pid {result.pid if result.pid is not None else 'unknown'}): "
        f"{s['soak_seconds']:.0f} s, {result.config.concurrency} clients, {s['sent']} requests",
        f"warm-up: {warm.get('requests')} requests ({warm.get('errors')} errors), {warm.get('tokens')} tokens "
        f"through a pool of {warm.get('pool_tokens') or '?'}; lowest free KV blocks seen "
        f"{warm.get('min_free_kv_blocks', '?')}/{warm.get('total_kv_blocks') or '?'}",
    ]
    primed = sum(n for by in s["priming"].values() for n in by.values())
    primed_failed = sum(n for by in s["priming"].values() for o, n in by.items() if o in hostile.FAILURES)
    lines.append(f"priming (before the start figures): {primed} requests of every kind, {primed_failed} failed")
    if warm.get("completed") == 0:
        lines.append(f"WARNING: no warm-up request completed, the KV pool was not warmed: {warm.get('error_samples')}")
    lines += ["", _outcome_table(s["outcomes"])]
    if s["failure_samples"]:
        lines += ["", "failures and unexpected answers seen:"] + [f"  {f}" for f in s["failure_samples"]]
    lines += ["", "server process at rest, start -> end:"]
    if result.pid is None:
        lines.append("  unknown pid: pass --server-pid to measure a server bench did not start")
    lines += [f"  {v.describe()}" for v in result.verdicts]
    if len(result.checkpoints) > 1:
        lines.append("  rss at rest: start " + ", ".join(
            [f"{result.start.rss_bytes / growth.MIB:.1f}" if result.start else "?"]
            + [f"{t:.0f} s {p.rss_bytes / growth.MIB:.1f}" for t, p in result.checkpoints if p]) + " MiB")
    if s["peak"]:
        peak = s["peak"]
        lines.append(f"  peak during the soak: rss {peak['rss_bytes'] / growth.MIB:.1f} MiB, "
                     f"{peak['num_fds']} fds, {peak['num_threads']} threads")
    lines.append(f"  /health at rest: start {s['start_health']}, end {s['end_health']}")
    h = s["health_s"]
    if h["n"]:
        lines.append(f"  /health during the soak: p50/p95/p99 {h['p50'] * 1e3:.1f}/{h['p95'] * 1e3:.1f}/"
                     f"{h['p99'] * 1e3:.1f} ms over {h['n']} probes, {s['health_failed']} not 200")
    verdict = "clean: no growth beyond noise" if result.is_clean else "NOT clean"
    verdict = "server died" if result.server_died else verdict
    if result.kv_blocks_leaked:
        verdict += f"; {result.kv_blocks_leaked} KV blocks not free at rest"
    return "\n".join(lines + ["", f"verdict: {verdict}"])


def _outcome_table(counts: dict[str, dict[str, int]]) -> str:
    rows = [["kind", "sent", *hostile.OUTCOMES]]
    rows += [[kind, str(sum(by.values())), *(str(by.get(o, 0)) for o in hostile.OUTCOMES)]
             for kind, by in counts.items()]
    return format_rows(rows)


def to_json(result: SoakResult) -> dict[str, Any]:
    return {**result.summary(), "process_samples": [asdict(s) for s in result.samples],
            "health_samples": [asdict(h) for h in result.health], "requests": [asdict(o) for o in result.outcomes]}
