"""The comparison with ggml's GEMMs reads test-backend-ops' lines and times Sluice's kernel of each type (a stand-in
binary prints ggml's lines; no timing asserted)."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest

from bench.experiments import ggml_gemm
from engine.native import available_isas, native_ops

ops = native_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the native step is not built (make install builds it)")

# test-backend-ops' perf lines as it prints them (colours included), at the stand-in shape below
PERF = "bs=[1,1],nr=[1,1],per=[0,1,2,3],k_v=0,o=1):  45 runs - 22796.42 us/run - 939.52 MFLOP/run - \x1b[1;34m"
LINES = f"""Testing 1 devices
  MUL_MAT(type_a=q4_K,type_b=f32,m=64,n=1,k=256,{PERF} 19.77 GFLOPS\x1b[0m
  MUL_MAT(type_a=q4_K,type_b=f32,m=64,n=8,k=256,{PERF} 41.20 GFLOPS\x1b[0m
  MUL_MAT(type_a=q4_K,type_b=f32,m=4096,n=8,k=14336,{PERF} 99.00 GFLOPS\x1b[0m
"""

def stand_in(tmp_path: Path) -> Path:
    binary = tmp_path / "test-backend-ops"
    (tmp_path / "lines.txt").write_text(LINES)
    binary.write_text(f"#!/bin/sh\ncat {tmp_path / 'lines.txt'}\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    return binary


def test_ggml_lines_are_read_at_the_shape_and_set_beside_sluice_kernels(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setattr(ggml_gemm, "M_OUT", 64)
    monkeypatch.setattr(ggml_gemm, "K_IN", 256)
    rates = ggml_gemm.ggml_rates(str(stand_in(tmp_path)), ["q4_K"], [1, 8], core=0)
    assert rates == {("q4_K", 1): pytest.approx(19.77e9 / 2), ("q4_K", 8): pytest.approx(41.2e9 / 2)}
    import os

    import torch

    from bench import kernels

    variant = available_isas(ops)[0]
    cores, threads, clock = os.sched_getaffinity(0), torch.get_num_threads(), kernels.CLOCK
    argv = ["--test-backend-ops", f"{variant}={stand_in(tmp_path)}", "--types", "q4_K", "--rows", "1,8", "--quick"]
    assert ggml_gemm.main(argv) == 0
    # the run's one core, one thread and CPU-time clock were its own: the tests after it got them (a whole suite
    # ran its native tests on one core, at a tenth of their speed)
    assert (os.sched_getaffinity(0), torch.get_num_threads(), kernels.CLOCK) == (cores, threads, clock)
    assert ops.isa() == f"isa_{variant}" or variant == "baseline"
    pattern = rf"^{variant}\s+q4_K\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x"
    rows = re.findall(pattern, capsys.readouterr().out, re.MULTILINE)
    assert [int(n) for n, *_ in rows] == [1, 8]
    for _, theirs, ours, ratio in rows:
        assert float(ours) > 0 and float(ratio) == pytest.approx(float(ours) / float(theirs), rel=0.1)


def test_an_unknown_type_is_refused_by_name() -> None:
    with pytest.raises(SystemExit):
        ggml_gemm.main(["--test-backend-ops", "avx2=x", "--types", "q3_K"])
