"""Server-side histograms from a Prometheus /metrics endpoint, as the difference between two scrapes."""

from __future__ import annotations

import math
from collections import defaultdict

import httpx

Buckets = dict[float, float]  # upper bound ("le") -> cumulative count
Snapshot = dict[str, Buckets]  # histogram name -> buckets


def parse_histograms(text: str) -> Snapshot:
    """Unlabelled (or summed over labels) `<name>_bucket{le="..."} count` lines of the exposition format."""
    snapshot: Snapshot = defaultdict(dict)
    for line in text.splitlines():
        if line.startswith("#") or "_bucket{" not in line:
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("_bucket{")
        le = next((part.split("=", 1)[1].strip('"') for part in labels.rstrip("}").split(",")
                   if part.strip().startswith("le=")), None)
        if le is None:
            continue
        bound = math.inf if le in ("+Inf", "Inf") else float(le)
        buckets = snapshot[name]
        buckets[bound] = buckets.get(bound, 0.0) + float(value)
    return dict(snapshot)


def delta(before: Snapshot, after: Snapshot) -> Snapshot:
    return {name: {le: count - before.get(name, {}).get(le, 0.0) for le, count in buckets.items()}
            for name, buckets in after.items()}


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus' estimate: linear interpolation inside the bucket that holds the q-th observation."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower  # the top finite bound: all we can say
            return lower + (bound - lower) * (rank - below) / (count - below) if count > below else bound
        lower, below = bound, count
    return lower


def summarize_histograms(snapshot: Snapshot) -> dict[str, dict[str, float | None]]:
    out = {}
    for name, buckets in sorted(snapshot.items()):
        count = buckets.get(math.inf, max(buckets.values(), default=0.0))
        if count > 0:
            out[name] = {"count": count, "p50": histogram_quantile(0.5, buckets), "p99": histogram_quantile(0.99, buckets)}
    return out


async def scrape(client: httpx.AsyncClient, root: str, headers: dict[str, str] | None = None) -> Snapshot | None:
    """None when the server has no /metrics (or it is not Prometheus text). headers: the API key, which a
    server with keys asks /metrics for too."""
    try:
        response = await client.get(root + "/metrics", headers=headers)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_histograms(response.text)
