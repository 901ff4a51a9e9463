"""Load shapes: closed loop (fixed concurrency), open loop (Poisson arrivals) and burst (all at once)."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench import health_probe, metrics
from bench.client import RequestOptions, RequestResult, Target, sample_health, send_request
from bench.stats import rate, summarize
from bench.workload import RequestSpec

MODES = ("closed", "rate", "burst")
PROBER_STARTUP = 1.0  # seconds for the /health prober process to import httpx and send its first probe


@dataclass(frozen=True)
class LoadShape:
    mode: str  # "closed": `level` streams; "rate": Poisson at `level` req/s; "burst": everything at once
    level: float
    max_duration: float | None = None  # stop issuing new requests after this many seconds
    seed: int = 0

    def label(self) -> str:
        if self.mode == "closed":
            return f"c={self.level:g}"
        return f"{self.level:g} req/s" if self.mode == "rate" else f"burst {self.level:g}"


@dataclass
class LevelResult:
    target: str
    shape: LoadShape
    duration: float
    requests: list[RequestResult]
    health: list[float] = field(default_factory=list)
    server_histograms: dict[str, dict[str, float | None]] = field(default_factory=dict)  # from /metrics
    loadavg: tuple[float, float] = (0.0, 0.0)  # 1-minute load average before and after: others' work skews results

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.requests if r.outcome == "ok"]
        completion = sum(r.completion_tokens for r in ok)
        prompt = sum(r.prompt_tokens or 0 for r in ok)
        return {
            "target": self.target,
            "mode": self.shape.mode,
            "level": self.shape.level,
            "sent": len(self.requests),
            "completed": len(ok),
            "rejected_429": sum(r.outcome == "429" for r in self.requests),
            "errors": sum(r.outcome == "error" for r in self.requests),
            "retried": sum(r.retried for r in self.requests),
            "duration_s": self.duration,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "usage_reported": all(r.usage_reported for r in ok),
            "requests_per_s": rate(len(ok), self.duration),
            "output_tokens_per_s": rate(completion, self.duration),
            "total_tokens_per_s": rate(completion + prompt, self.duration),
            "admission_s": summarize(r.admission for r in self.requests if r.admission is not None),
            "client_queue_s": summarize(r.client_queue for r in self.requests if r.client_queue is not None),
            "ttft_s": summarize(r.ttft for r in ok if r.ttft is not None),
            "itl_s": summarize(gap for r in ok for gap in r.itl),
            "e2e_s": summarize(r.e2e for r in ok if r.e2e is not None),
            "health_s": summarize(self.health),
            "server_histograms": self.server_histograms,
            "loadavg_before_after": self.loadavg,
            "error_samples": sorted({r.error for r in self.requests if r.error and r.status != 429})[:5],
        }


def make_client(concurrency: int, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    # No pool limit: httpx's default of 100 connections would queue requests inside the client and
    # show up as admission latency that the server never caused.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(concurrency, 16))
    timeout = httpx.Timeout(connect=30.0, read=None, write=30.0, pool=None)
    return httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport)


async def run_level(
    target: Target,
    specs: list[RequestSpec],
    shape: LoadShape,
    options: RequestOptions,
    health_interval: float | None = 0.05,
    on_done: Callable[[RequestResult], None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> LevelResult:
    """Sends `specs` in the given shape; every spec that was sent has exactly one result."""
    results: list[RequestResult] = []
    health: list[float] = []
    width = int(shape.level) if shape.mode == "closed" else len(specs)
    async with make_client(width, transport) as client, make_client(1, transport) as health_client:
        load_before = os.getloadavg()[0]
        before = await metrics.scrape(health_client, target.root, target.headers)
        sampler = prober = None
        if health_interval and transport is None:
            # A process of its own: the load generator's busy event loop adds nothing to the server's latencies.
            prober = health_probe.ProbeProcess(target.root, health_interval)
            await prober.start()
            await asyncio.sleep(PROBER_STARTUP)
        elif health_interval:
            sampler = asyncio.create_task(sample_health(health_client, target, health_interval, health))
        start, started_at = time.perf_counter(), time.monotonic()  # the prober's samples carry monotonic times
        deadline = start + shape.max_duration if shape.max_duration else None

        async def one(spec: RequestSpec) -> None:
            result = await send_request(client, target, spec, options, start)
            results.append(result)
            if on_done is not None:
                on_done(result)

        try:
            if shape.mode == "closed":
                await _closed_loop(specs, int(shape.level), one, deadline)
            elif shape.mode == "rate":
                await _poisson(specs, shape.level, one, deadline, random.Random(shape.seed))
            else:
                await asyncio.gather(*(one(spec) for spec in specs))
            end = time.perf_counter()
        finally:
            if sampler is not None:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
            if prober is not None:  # the level's own probes, not those of the prober's idle second before it
                health += server_health([s for s in await prober.stop() if s.at >= started_at])
        after = await metrics.scrape(health_client, target.root, target.headers) if before is not None else None
    results.sort(key=lambda r: r.index)
    server = metrics.summarize_histograms(metrics.delta(before, after)) if before and after else {}
    loadavg = (load_before, os.getloadavg()[0])
    return LevelResult(target.name, shape, end - start, results, health, server, loadavg)


def server_health(samples: list[health_probe.HealthSample]) -> list[float]:
    """Latencies of the probes a server with /health answered (failed probes count with their full wait)."""
    if samples and all(s.status in (404, 405) for s in samples):
        return []  # no /health on this server
    return [s.latency for s in samples if s.status not in (404, 405)]


async def _closed_loop(specs: list[RequestSpec], concurrency: int, one: Callable, deadline: float | None) -> None:
    queue = list(reversed(specs))

    async def worker() -> None:
        while queue and (deadline is None or time.perf_counter() < deadline):
            await one(queue.pop())

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))


async def _poisson(
    specs: list[RequestSpec], per_second: float, one: Callable, deadline: float | None, rng: random.Random
) -> None:
    tasks = []
    next_at = time.perf_counter()
    for spec in specs:
        next_at += rng.expovariate(per_second)
        if deadline is not None and next_at >= deadline:
            break
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        tasks.append(asyncio.create_task(one(spec)))
    await asyncio.gather(*tasks)
