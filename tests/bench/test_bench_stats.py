from __future__ import annotations

import pytest

from bench.stats import percentile, rate, summarize


def test_percentiles_interpolate_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == pytest.approx(2.5)  # rank 1.5
    assert percentile(values, 95) == pytest.approx(3.85)  # rank 2.85
    assert percentile(values, 99) == pytest.approx(3.97)  # rank 2.97
    assert percentile(values, 100) == 4.0


def test_percentiles_of_ten_values() -> None:
    values = list(range(10, 110, 10))  # 10 .. 100
    assert percentile(values, 50) == pytest.approx(55.0)  # rank 4.5
    assert percentile(values, 90) == pytest.approx(91.0)  # rank 8.1
    assert percentile(values, 99) == pytest.approx(99.1)  # rank 8.91


def test_single_value_and_empty_input() -> None:
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    summary = summarize([])
    assert summary == {"n": 0, "mean": None, "min": None, "max": None, "p50": None, "p95": None, "p99": None}


def test_summarize_accepts_a_generator() -> None:
    summary = summarize(x / 10 for x in range(1, 6))
    assert summary["n"] == 5
    assert summary["mean"] == pytest.approx(0.3)
    assert (summary["min"], summary["max"]) == (0.1, 0.5)
    assert summary["p50"] == pytest.approx(0.3)
    assert summary["p95"] == pytest.approx(0.48)  # rank 3.8: 0.4 + 0.8 * 0.1


def test_bad_percentile_and_rate() -> None:
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    assert rate(10, 2.0) == 5.0
    assert rate(10, 0.0) is None


def test_histogram_quantiles_from_two_scrapes() -> None:
    from bench.metrics import delta, histogram_quantile, parse_histograms, summarize_histograms

    def exposition(counts: tuple[int, int, int, int]) -> str:
        les = ("0.001", "0.01", "0.1", "+Inf")
        lines = ["# TYPE x_seconds histogram"] + [f'x_seconds_bucket{{le="{le}"}} {c}.0' for le, c in zip(les, counts)]
        return "\n".join(lines + [f"x_seconds_count {counts[-1]}.0", "other_total 3.0"])

    before = parse_histograms(exposition((1, 1, 1, 1)))
    after = parse_histograms(exposition((5, 9, 11, 11)))  # 10 new: 4 <= 1 ms, 4 in (1, 10] ms, 2 in (10, 100] ms
    buckets = delta(before, after)["x_seconds"]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.001 + 0.009 * 1 / 4)  # rank 5: 1 into the 2nd bucket
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.01 + 0.09 * 1.9 / 2)  # rank 9.9
    assert histogram_quantile(0.2, buckets) == pytest.approx(0.001 * 2 / 4)
    assert histogram_quantile(1.0, {0.1: 1.0, float("inf"): 2.0}) == 0.1  # in +Inf: the top finite bound
    assert histogram_quantile(0.5, {float("inf"): 0.0}) is None
    assert summarize_histograms(buckets and {"x_seconds": buckets})["x_seconds"]["count"] == 10
