"""Measure the server's responsiveness under load (figures to report, not test assertions).

    .venv/bin/python -m tests.support.server_latency [--model ''] [--url http://127.0.0.1:8000]

Without --url it starts `python -m web.server` on a free port (the default model unless --model) and stops it
with SIGTERM at the end. Prints: server-side admission p50/p99 during a 256-request burst (from /metrics),
client time to response headers p50/p99 during a 300-stream burst, /health p50/p99 while 64 streams decode.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import time

import httpx

from tests.support.server_harness import free_port, health, server_subprocess, wait_until


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def histogram_buckets(base_url: str, name: str) -> list[tuple[float, float]]:
    text = httpx.get(f"{base_url}/metrics").text
    bucket = re.compile(rf'^{name}_bucket\{{le="([^"]+)"\}} (\S+)$', re.MULTILINE)
    return [(float(le), float(count)) for le, count in bucket.findall(text)]


def admission_buckets(base_url: str) -> dict[str, list[tuple[float, float]]]:
    return {name: histogram_buckets(base_url, f"sluice_{name}_seconds") for name in ("admission", "body_wait")}


def histogram_quantile(before: list[tuple[float, float]], after: list[tuple[float, float]], q: float) -> float:
    """Like PromQL's histogram_quantile over the difference of two scrapes (linear within a bucket)."""
    counts = [(le, a - b) for (le, a), (_, b) in zip(after, before)]
    total = counts[-1][1]
    rank = q * total
    lower_le, lower_count = 0.0, 0.0
    for le, count in counts:
        if count >= rank:
            if le == float("inf"):
                return lower_le
            width = count - lower_count
            return lower_le + (le - lower_le) * ((rank - lower_count) / width if width else 1.0)
        lower_le, lower_count = le, count
    return lower_le


def chat_body(model: str, max_tokens: int, i: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"Write a short story about the number {i}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


async def one_stream(client: httpx.AsyncClient, body: dict) -> tuple[int, float]:
    started = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        headers_after = time.perf_counter() - started
        async for _ in response.aiter_lines():
            pass
    return response.status_code, headers_after


async def burst(base_url: str, model: str, n: int, max_tokens: int) -> list[tuple[int, float]]:
    limits = httpx.Limits(max_connections=n + 16, max_keepalive_connections=n + 16)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        return await asyncio.gather(*(one_stream(client, chat_body(model, max_tokens, i)) for i in range(n)))


async def health_while_decoding(base_url: str, model: str, streams: int, polls: int) -> list[float]:
    limits = httpx.Limits(max_connections=streams + 16)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        tasks = [asyncio.create_task(one_stream(client, chat_body(model, 256, i))) for i in range(streams)]
        while (await client.get("/health")).json()["running"] < streams:
            await asyncio.sleep(0.05)
        latencies = []
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as prober:
            for _ in range(polls):
                started = time.perf_counter()
                await prober.get("/health")
                latencies.append(time.perf_counter() - started)
                await asyncio.sleep(0.02)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return latencies


def measure(base_url: str) -> None:
    model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
    before = admission_buckets(base_url)
    results = asyncio.run(burst(base_url, model, 256, max_tokens=4))
    after = admission_buckets(base_url)
    print(f"256-request burst: {sum(s == 200 for s, _ in results)} accepted, {sum(s == 429 for s, _ in results)} 429")
    for name, label in (("admission", "server-side admission"), ("body_wait", "body wait (before admission)")):
        p50, p99 = (histogram_quantile(before[name], after[name], q) * 1e3 for q in (0.5, 0.99))
        print(f"  {label} p50 {p50:.3f} ms, p99 {p99:.3f} ms")

    results = asyncio.run(burst(base_url, model, 300, max_tokens=4))
    to_headers = [t for _, t in results]
    print(f"300-stream burst: {sum(s == 200 for s, _ in results)} accepted, {sum(s == 429 for s, _ in results)} 429")
    print(f"  client time to headers p50 {percentile(to_headers, 0.5) * 1e3:.1f} ms, "
          f"p99 {percentile(to_headers, 0.99) * 1e3:.1f} ms")  # fmt: skip

    wait_until(lambda: health(base_url)[1].get("running") == 0, timeout=300)
    latencies = asyncio.run(health_while_decoding(base_url, model, streams=64, polls=200))
    print(f"/health while 64 streams decode: p50 {percentile(latencies, 0.5) * 1e3:.2f} ms, "
          f"p99 {percentile(latencies, 0.99) * 1e3:.2f} ms, max {max(latencies) * 1e3:.2f} ms")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", help="measure an already running server")
    parser.add_argument("--model", default="", help="the model for the started server ('' = the default)")
    args = parser.parse_args()
    if args.url:
        measure(args.url)
        return
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    process = server_subprocess(["--port", str(port), "--model", args.model, "--log-level", "warning"])
    try:
        wait_until(lambda: health(base_url)[0] == 200 or process.poll() is not None, timeout=300)
        measure(base_url)
    finally:
        process.send_signal(signal.SIGTERM)
        print(f"server exit code {process.wait(timeout=120)}")


if __name__ == "__main__":
    main()
