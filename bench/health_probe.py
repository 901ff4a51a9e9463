"""GET /health, recorded whatever it answers: a probe that times out or fails counts with its full wait."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from dataclasses import asdict, dataclass
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


class ProbeProcess:
    """The probing loop in a process of its own, so that the load generator's event loop (busy writing megabyte
    bodies) adds nothing to the latencies. Runs from start() until stop(), which returns its samples."""

    def __init__(self, root: str, interval: float) -> None:
        self.root = root
        self.interval = interval
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.health_probe", self.root, str(self.interval),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)

    async def stop(self) -> list[HealthSample]:
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.close()  # end of input: the prober stops and prints what it saw
        output, _ = await self.process.communicate()
        return [HealthSample(**sample) for sample in json.loads(output or b"[]")]


async def _probe_until_end_of_input(root: str, interval: float) -> list[HealthSample]:
    samples: list[HealthSample] = []
    end_of_input = asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1)) as client:
        sampler = asyncio.create_task(sample_until_cancelled(client, root, interval, samples))
        await end_of_input
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    return samples


if __name__ == "__main__":
    # A terminal's Ctrl-C reaches the whole process group: the load generator stops this prober (its stdin closes,
    # as when the generator dies), so the signal is not for it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    found = asyncio.run(_probe_until_end_of_input(sys.argv[1], float(sys.argv[2])))
    sys.stdout.write(json.dumps([asdict(s) for s in found]))
