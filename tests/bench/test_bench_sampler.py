"""`python -m bench sampler` runs in seconds on small shapes, so that it cannot rot (no timing is asserted)."""

from __future__ import annotations

import pytest

from bench.experiments import sampler
from engine.native import native_ops

pytestmark = pytest.mark.skipif(native_ops() is None, reason="the native step is not built (make install builds it)")


def test_the_sampler_benchmark_times_both_paths(capsys: pytest.CaptureFixture) -> None:
    assert sampler.main(["--vocab", "1000", "--rows", "1,3", "--calls", "5"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1000 |")]
    assert len(lines) == 6  # 2 row counts x 3 parameter sets (greedy, temperature 1, top-p)
    for line in lines:
        torch_ms, native_ms = (float(cell) for cell in line.split("|")[4:6])
        assert torch_ms > 0 and native_ms > 0
