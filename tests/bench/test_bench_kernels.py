"""bench.kernels, the kernel benchmark, as a smoke test: it runs every variant this CPU has in a few seconds and
reports each figure it promises. No timing is asserted (speed belongs in bench/, measured, not in a unit test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import kernels
from engine.native import available_isas, native_ops

ops = native_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the native step is not built (make install builds it)")


def test_the_kernel_benchmark_reports_every_variant_and_row_count(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "kernels.json"
    assert kernels.main(["--quick", "--rows", "1,8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert list(report["variants"]) == available_isas(ops)
    for variant, figures in report["variants"].items():
        assert f"{variant}: register-only multiply-add peak" in printed
        assert figures["madd_peak"] > 0 and figures["madd_peak_int8"] > 0 and figures["read_bandwidth"] > 0
        measured = {(r["what"].split()[0], r["rows"]) for r in figures["results"]}
        gemms = {(kind, m) for kind in ("q4", "q4i8", "q4f", "q8l", "q8li8", "q4k", "q5", "q5k", "q6", "q8", "q8i8") for m in (1, 8)}
        assert gemms | {("decode", 1), ("decode", 8), ("prefill", 32)} <= measured
        prefills = [r["what"] for r in figures["results"] if r["what"].startswith("prefill")]
        assert prefills == ["prefill chunk 32 tok, 1 layer, exact", "prefill chunk 32 tok, 1 layer, int8",
                            "prefill chunk 32 tok after 64, 1 layer, int8"]  # fmt: skip
        assert all(r["seconds"] > 0 and r["rate"] > 0 for r in figures["results"])


def test_a_variant_the_cpu_lacks_is_refused_by_name() -> None:
    with pytest.raises(SystemExit, match="cannot run the nonsense kernels"):
        kernels.main(["--quick", "--variants", "nonsense"])
