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
