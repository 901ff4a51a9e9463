"""`python -m bench --abuse`: /health latency while bad input is being sent and rejected.

First /health alone (the baseline, same run), then the same probing while `abusers` clients send, one after
another, megabytes of prompt text, ~1M token ids, bodies over the size limit, malformed bodies and huge stop
lists. The server should reject each quickly and keep its event loop free: the target is /health p99
under 50 ms. Every request and every probe is counted, a failed probe with its whole wait.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from bench import health_probe, hostile
from bench.bad_input import BadRequest, catalogue
from bench.client import Target
from bench.health_probe import HealthSample
from bench.report import format_rows
from bench.runner import make_client
from bench.stats import summarize

ABUSE_KINDS = ("megabytes-of-text", "million-token-ids", "oversized-body", "huge-stop-list", "garbage-json",
               "not-json", "wrong-types")
HEALTH_P99_TARGET_S = 0.050


@dataclass(frozen=True)
class AbuseConfig:
    duration: float = 30.0
    abusers: int = 4
    baseline_seconds: float = 5.0
    health_interval: float = 0.02
    request_timeout: float = 60.0
    seed: int = 0


@dataclass
class AbuseResult:
    url: str
    config: AbuseConfig
    baseline: list[HealthSample] = field(default_factory=list)
    under_load: list[HealthSample] = field(default_factory=list)
    outcomes: list[hostile.Outcome] = field(default_factory=list)
    abuse_seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        by_kind: dict[str, Counter] = {}
        for o in self.outcomes:
            by_kind.setdefault(o.kind, Counter())[f"{o.outcome} {o.status}" if o.status else o.outcome] += 1
        loaded = summarize(health_probe.latencies(self.under_load))
        return {
            "url": self.url,
            "config": vars(self.config),
            "abuse_seconds": self.abuse_seconds,
            "sent": len(self.outcomes),
            "outcomes": {kind: dict(c) for kind, c in sorted(by_kind.items())},
            "failures": sum(o.outcome in hostile.FAILURES for o in self.outcomes),
            "failure_samples": sorted({f"{o.kind}: {o.detail}" for o in self.outcomes
                                       if o.outcome in hostile.FAILURES | {"unexpected"}})[:10],
            "baseline_health_s": summarize(health_probe.latencies(self.baseline)),
            "health_s": loaded,
            "health_failed": health_probe.num_failed(self.under_load),
            "meets_target": loaded["p99"] is not None and loaded["p99"] < HEALTH_P99_TARGET_S
                            and health_probe.num_failed(self.under_load) == 0,
        }


async def _abuser(client: httpx.AsyncClient, root: str, requests: list[BadRequest], offset: int, deadline: float,
                  timeout: float, out: list[hostile.Outcome]) -> None:
    index = offset
    while time.monotonic() < deadline:
        out.append(await hostile.send_bad(client, root, requests[index % len(requests)], timeout))
        index += 1


async def _probe_for(root: str, seconds: float, interval: float) -> list[HealthSample]:
    prober = health_probe.ProbeProcess(root, interval)
    await prober.start()
    await asyncio.sleep(seconds)
    return await prober.stop()


async def run_abuse(target: Target, config: AbuseConfig, log=print) -> AbuseResult:
    hostile.require_loopback(target.root)
    result = AbuseResult(target.root, config)
    by_name = {bad.name: bad for bad in catalogue(target.model or "", config.seed)}
    requests = [by_name[name] for name in ABUSE_KINDS]
    log(f"abuse: /health alone for {config.baseline_seconds:g} s")
    result.baseline = await _probe_for(target.root, config.baseline_seconds, config.health_interval)
    log(f"abuse: {config.abusers} clients sending bad input for {config.duration:g} s")
    # Probing lasts as long as the last abuser's last request (sent before the deadline), in a process of its
    # own: this event loop is busy writing megabyte bodies and would delay the probes' reads.
    prober = health_probe.ProbeProcess(target.root, config.health_interval)
    await prober.start()
    started = time.monotonic()
    deadline = started + config.duration
    try:
        async with make_client(config.abusers) as client:
            await asyncio.gather(*(_abuser(client, target.root, requests, i * 2, deadline, config.request_timeout,
                                           result.outcomes) for i in range(config.abusers)))
    finally:
        result.under_load = await prober.stop()
    result.abuse_seconds = time.monotonic() - started
    return result


def report(result: AbuseResult) -> str:
    s = result.summary()
    rows = [["/health", "probes", "not 200", "p50 ms", "p95 ms", "p99 ms", "max ms"]]
    for name, key, samples in (("alone", "baseline_health_s", result.baseline),
                               ("under abuse", "health_s", result.under_load)):
        h = s[key]
        rows.append([name, str(h["n"]), str(health_probe.num_failed(samples))]
                    + ["-" if h[q] is None else f"{h[q] * 1e3:.1f}" for q in ("p50", "p95", "p99", "max")])
    lines = [f"abuse of {result.url}: {s['abuse_seconds']:.0f} s, {result.config.abusers} clients, {s['sent']} bad "
             f"requests ({s['failures']} failed: 5xx, reset or timeout)", "", format_rows(rows), "",
             "answers by kind (outcome and status):"]
    lines += [f"  {kind}: " + ", ".join(f"{k} x{n}" for k, n in sorted(by.items()))
              for kind, by in s["outcomes"].items()]
    if s["failure_samples"]:
        lines += ["failures and unexpected answers seen:"] + [f"  {f}" for f in s["failure_samples"]]
    p99 = s["health_s"]["p99"]
    target = f"{HEALTH_P99_TARGET_S * 1e3:.0f} ms"
    meets = "meets" if s["meets_target"] else "MISSES"
    verdict = "no probes" if p99 is None else f"/health p99 {p99 * 1e3:.1f} ms: {meets} the {target} target"
    return "\n".join(lines + ["", verdict])


def to_json(result: AbuseResult) -> dict[str, Any]:
    return {**result.summary(), "baseline_samples": [asdict(h) for h in result.baseline],
            "health_samples": [asdict(h) for h in result.under_load], "requests": [asdict(o) for o in result.outcomes]}
