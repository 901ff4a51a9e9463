"""The decode-step benchmark runs end to end on the default model (no timing asserted)."""

from __future__ import annotations

import re

import pytest

from bench.experiments import step
from engine.native import available_isas, native_ops

ops = native_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the native step is not built (make install builds it)")


def test_the_step_benchmark_reports_each_variant_and_row_count(capsys: pytest.CaptureFixture) -> None:
    variants = available_isas(ops)
    assert step.main(["--rows", "1,3", "--calls", "2", "--variants", ",".join(variants)]) == 0
    printed = capsys.readouterr().out
    measured = re.findall(r"^(\w+)\s+(\d+)" + r"\s+([\d.]+) /\s+([\d.]+)" * 3 + "$", printed, re.MULTILINE)
    assert [(v, int(m)) for v, m, *_ in measured] == [(v, m) for v in variants for m in (1, 3)]
    assert all(float(t) > 0 for row in measured for t in row[2:])
