"""What clients that never read cost a server: `python -m bench never-read --url URL --streams 40`.

First N streams read to the end (so that the high-water marks of N streams are reached), then N streaming
requests on sockets with a 4 KiB receive buffer, none of them read for `--seconds`; the server's RSS (from
/proc, the process listening on the URL's port) is sampled every second throughout. Loopback servers only.
"""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter

from bench import hostile
from bench.client import RequestOptions, Target, discover_model
from bench.proc import ProcessSample, listening_pid, read_process
from bench.runner import make_client
from bench.workload import LengthDist, build_workload

MIB = 1024 * 1024


async def _sample_rss(pid: int, out: list[ProcessSample]) -> None:
    while True:
        out.append(read_process(pid))
        await asyncio.sleep(1.0)


async def _measure(pid: int, clients) -> tuple[int, int, Counter[str]]:
    """(RSS before, peak RSS while the clients ran, outcomes by kind/outcome/status)."""
    before = read_process(pid).rss_bytes
    samples: list[ProcessSample] = []
    sampler = asyncio.create_task(_sample_rss(pid, samples))
    try:
        outcomes = await clients
    finally:
        sampler.cancel()
    peak = max([s.rss_bytes for s in samples] + [before])
    return before, peak, Counter(f"{o.kind}:{o.outcome}:{o.status}" + (f" ({o.detail})" if o.detail else "") for o in outcomes)


async def run(url: str, num_streams: int, seconds: float, output_tokens: int, read_output_tokens: int) -> None:
    host, port = hostile.require_loopback(url)
    pid = listening_pid(port)
    if pid is None:
        raise SystemExit(f"no readable process listens on port {port}")
    async with make_client(1) as client:
        target = Target("sluice", url, await discover_model(client, Target("sluice", url)))
    options = RequestOptions("completions", 0.0, True, True, timeout=seconds + 900)
    specs = build_workload(num_streams, LengthDist("fixed", 64), LengthDist("fixed", read_output_tokens), seed=0)
    async with make_client(num_streams) as client:
        read = asyncio.gather(*(hostile.stream_full(client, target, spec, options) for spec in specs))
        before, peak, outcomes = await _measure(pid, read)
    print(f"{num_streams} streams read to the end: RSS {before / MIB:.0f} MiB before, "
          f"peak {peak / MIB:.0f} MiB (+{(peak - before) / MIB:.0f}); {dict(outcomes)}")

    specs = build_workload(num_streams, LengthDist("fixed", 64), LengthDist("fixed", output_tokens), seed=0)
    unread = asyncio.gather(*(hostile.never_read(host, port, target, spec, options, seconds) for spec in specs))
    before, peak, outcomes = await _measure(pid, unread)
    print(f"{num_streams} never-read streams for {seconds:.0f} s: RSS {before / MIB:.0f} MiB before, "
          f"peak {peak / MIB:.0f} MiB (+{(peak - before) / MIB:.0f}); {dict(outcomes)}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--streams", type=int, default=40)
    p.add_argument("--seconds", type=float, default=75.0, help="how long the never-read clients hold on")
    p.add_argument("--output-tokens", type=int, default=2048, help="max_tokens of a never-read stream (ignore_eos)")
    p.add_argument("--read-output-tokens", type=int, default=256, help="max_tokens of a stream that is read")
    args = p.parse_args(argv)
    asyncio.run(run(args.url, args.streams, args.seconds, args.output_tokens, args.read_output_tokens))


if __name__ == "__main__":
    main()
