"""GET /health, recorded whatever it answers: a probe that times out or fails counts with its full wait."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

PROBE_TIMEOUT = 5.0


@dataclass(frozen=True)
class HealthSample:
    at: float  # time.monotonic()
    latency: float  # seconds; the whole wait when the probe failed
    status: int | None  # None: no answer (timeout, reset)
    body: dict[str, Any] | None = None  # Sluice's /health reports state, queues and KV blocks


async def probe(client: httpx.AsyncClient, root: str, timeout: float = PROBE_TIMEOUT) -> HealthSample:
    start = time.perf_counter()
    at = time.monotonic()
    try:
        response = await client.get(root + "/health", timeout=timeout)
        body = response.json() if response.headers.get("content-type", "").startswith("application/json") else None
    except (httpx.HTTPError, ValueError):
        return HealthSample(at, time.perf_counter() - start, None)
    return HealthSample(at, time.perf_counter() - start, response.status_code, body if isinstance(body, dict) else None)


async def sample_until_cancelled(client: httpx.AsyncClient, root: str, interval: float,
                                 out: list[HealthSample]) -> None:
    while True:
        sample = await probe(client, root)
        out.append(sample)
        await asyncio.sleep(max(0.0, interval - sample.latency) if sample.status is not None else interval)


def latencies(samples: list[HealthSample]) -> list[float]:
    return [s.latency for s in samples]


def num_failed(samples: list[HealthSample]) -> int:
    return sum(s.status != 200 for s in samples)


def is_idle(sample: HealthSample) -> bool:
    """Nothing queued or running (Sluice's fields; a server without them counts as idle when it answers)."""
    body = sample.body or {}
    return sample.status == 200 and all(body.get(key, 0) == 0 for key in ("waiting", "running", "pending"))
