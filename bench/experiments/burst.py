"""Time to response headers in a burst, measured by a lean client: `python -m bench burst --url URL --size 256`.

With `--streams N` the same client keeps N streams going instead (a closed loop: each sends its next request when
its last one ends, `--size` requests in all), so the headers' time is the server's while it streams to N others;
the first wave (N at once) is reported apart.

httpx costs the load generator about a millisecond of its own event loop per request, which a burst of
hundreds turns into latency the server never caused. Here every connection is opened first; then all requests
are written at once as prebuilt bytes, and each one's time runs from its write to its status line. The same
burst of GET /health (the HTTP stack alone, no engine work) runs first: the floor of what the server's
framework costs per request on this machine. The streams are then read to their end.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson

from bench import hostile
from bench.client import RequestOptions, Target, build_body, discover_model, endpoint_path
from bench.runner import make_client
from bench.stats import summarize
from bench.workload import LengthDist, build_workload


async def _one(host: str, port: int, request: bytes, start: asyncio.Event, timeout: float) -> tuple[float, bytes]:
    """(seconds from write to status line, status line)"""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        await start.wait()
        sent = time.perf_counter()
        writer.write(request)
        status = await asyncio.wait_for(reader.readline(), timeout)
        headers = time.perf_counter() - sent
        async with asyncio.timeout(timeout):
            while await reader.read(1 << 16):  # the server closes after the stream (Connection: close)
                pass
        return headers, status.strip()
    finally:
        writer.close()


async def burst(host: str, port: int, requests: list[bytes], timeout: float) -> tuple[list[float], set[bytes]]:
    start = asyncio.Event()
    tasks = [asyncio.create_task(_one(host, port, r, start, timeout)) for r in requests]
    await asyncio.sleep(0.5)  # every connection accepted before the burst
    start.set()
    results = await asyncio.gather(*tasks)
    return [seconds for seconds, _ in results], {status for _, status in results}


async def closed_loop(host: str, port: int, requests: list[bytes], streams: int,
                      timeout: float) -> tuple[list[float], set[bytes]]:  # fmt: skip
    """Seconds from write to status line of each request, in sending order, with `streams` in flight at a time."""
    start = asyncio.Event()
    start.set()
    times: list[float] = [0.0] * len(requests)
    statuses: set[bytes] = set()
    queue = iter(range(len(requests)))

    async def stream() -> None:
        for i in queue:
            times[i], status = await _one(host, port, requests[i], start, timeout)
            statuses.add(status)

    await asyncio.gather(*(stream() for _ in range(streams)))
    return times, statuses


def post(path: str, body: dict) -> bytes:
    data = orjson.dumps(body)
    head = f"POST {path} HTTP/1.1\r\nhost: sluice\r\nconnection: close\r\ncontent-type: application/json\r\n"
    return head.encode() + f"content-length: {len(data)}\r\n\r\n".encode() + data


def report(name: str, latencies: list[float], statuses: set[bytes]) -> None:
    s = summarize(latencies)
    print(f"{name}: {s['n']} requests, time to headers p50/p95/p99/max "
          f"{s['p50'] * 1e3:.1f}/{s['p95'] * 1e3:.1f}/{s['p99'] * 1e3:.1f}/{s['max'] * 1e3:.1f} ms; "
          f"{', '.join(sorted(x.decode(errors='replace') for x in statuses))}")


async def run(url: str, size: int, prompt_tokens: int, output_tokens: int, timeout: float, streams: int) -> None:
    host, port = hostile.require_loopback(url)
    async with make_client(1) as client:
        target = Target("sluice", url, await discover_model(client, Target("sluice", url)))
    if streams:
        options = RequestOptions("chat", 0.0, True, True, timeout)
        specs = build_workload(size, LengthDist("fixed", prompt_tokens), LengthDist("fixed", output_tokens), seed=0)
        requests = [post(endpoint_path(options), build_body(target, spec, options)) for spec in specs]
        times, statuses = await closed_loop(host, port, requests, streams, timeout)
        report(f"{streams} streaming chats at a time, {size} in all", times, statuses)
        report(f"  their first wave ({streams} at once)", times[:streams], set())
        report("  after it", times[streams:], set())
        return
    health = [b"GET /health HTTP/1.1\r\nhost: sluice\r\nconnection: close\r\n\r\n"] * size
    report(f"burst of {size} GET /health", *await burst(host, port, health, timeout))
    options = RequestOptions("completions", 0.0, True, True, timeout)
    specs = build_workload(size, LengthDist("fixed", prompt_tokens), LengthDist("fixed", output_tokens), seed=0)
    requests = [post(endpoint_path(options), build_body(target, spec, options)) for spec in specs]
    report(f"burst of {size} streaming completions ({prompt_tokens}-token prompts, {output_tokens} tokens out)",
           *await burst(host, port, requests, timeout))  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--streams", type=int, default=0, help="a closed loop of this many chat streams, not a burst")
    args = p.parse_args(argv)
    asyncio.run(run(args.url, args.size, args.prompt_tokens, args.output_tokens, args.timeout, args.streams))


if __name__ == "__main__":
    main()
