"""Percentiles and per-metric summaries (pure Python: the bench must not need numpy)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

PERCENTILES = (50.0, 95.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default method); None for no data."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Iterable[float], percentiles: Sequence[float] = PERCENTILES) -> dict[str, float | int | None]:
    """{"n", "mean", "min", "max", "p50", "p95", "p99"}; statistics are None when there is no data."""
    data = sorted(values)
    summary: dict[str, float | int | None] = {
        "n": len(data),
        "mean": sum(data) / len(data) if data else None,
        "min": data[0] if data else None,
        "max": data[-1] if data else None,
    }
    for q in percentiles:
        summary[f"p{q:g}"] = percentile(data, q)
    return summary


def rate(count: float, seconds: float) -> float | None:
    return count / seconds if seconds > 0 else None
