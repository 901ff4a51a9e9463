"""Did a server grow over a soak? Idle figures at the start and the end, compared with a noise allowance.

Both figures are taken at rest (no request in flight, connections closed), so file descriptors and threads
must come back to their start count: the allowance only covers a lazily opened file or a pool thread that
has not yet timed out. RSS never comes back exactly (allocator arenas keep freed memory), so it is allowed
a floor plus a fraction of the start; a leak of a few KiB per request over thousands of requests, or the
~185 MiB that 40 never-read streams cost on main, stands well clear of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.proc import ProcessSample

MIB = 1 << 20
RSS_FLOOR_BYTES = 32 * MIB
RSS_FRACTION = 0.03
FD_ALLOWANCE = 2
THREAD_ALLOWANCE = 2


@dataclass(frozen=True)
class Growth:
    name: str  # "rss_bytes" | "num_fds" | "num_threads"
    start: int
    end: int
    allowance: int  # growth up to this much is noise

    @property
    def delta(self) -> int:
        return self.end - self.start

    @property
    def is_growth(self) -> bool:
        return self.delta > self.allowance

    def describe(self) -> str:
        if self.name == "rss_bytes":
            start, end, delta, allowance = (f"{v / MIB:.1f}" for v in (self.start, self.end, self.delta, self.allowance))
            values = f"{start} -> {end} MiB ({'+' if self.delta >= 0 else ''}{delta}, noise <= {allowance})"
        else:
            values = f"{self.start} -> {self.end} ({self.delta:+d}, noise <= {self.allowance})"
        label = self.name.removeprefix("num_").removesuffix("_bytes")
        return f"{label:8s} {values}: {'GROWTH' if self.is_growth else 'ok'}"


def rss_allowance(start_bytes: int, floor: int = RSS_FLOOR_BYTES, fraction: float = RSS_FRACTION) -> int:
    return max(floor, round(fraction * start_bytes))


def judge(start: ProcessSample, end: ProcessSample, rss_floor: int = RSS_FLOOR_BYTES) -> list[Growth]:
    return [
        Growth("rss_bytes", start.rss_bytes, end.rss_bytes, rss_allowance(start.rss_bytes, rss_floor)),
        Growth("num_fds", start.num_fds, end.num_fds, FD_ALLOWANCE),
        Growth("num_threads", start.num_threads, end.num_threads, THREAD_ALLOWANCE),
    ]


def has_grown(verdicts: list[Growth]) -> bool:
    return any(v.is_growth for v in verdicts)
