"""The variants-in-turns benchmark runs end to end on small turns (no timing asserted)."""

from __future__ import annotations

import argparse
import os
import re

import pytest

from bench.experiments import variants as bench_variants
from engine.native import available_isas, native_ops

ops = native_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the native step is not built (make install builds it)")


def test_every_variant_takes_its_turns_and_gets_a_rate_and_a_ratio(monkeypatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(bench_variants, "TURN_SECONDS", 0.001)
    names = available_isas(ops)
    kernels = "q4i8:down,q8i8:lm_head"
    assert bench_variants.main(["--variants", ",".join(names), "--rows", "4", "--turns", "2", "--kernels", kernels]) == 0
    lines = re.findall(r"^(q4i8 down|q8i8 lm_head)\s+4\s+(.*)$", capsys.readouterr().out, re.MULTILINE)
    assert [kernel for kernel, _ in lines] == ["q4i8 down", "q8i8 lm_head"]
    for _, figures in lines:
        rates, ratios = figures.split()[: len(names)], figures.split()[len(names) :]
        assert all(float(r) > 0 for r in rates) and len(ratios) == len(names) - 1
    assert ops.isa() == f"isa_{names[0]}" or names[0] == "baseline"  # the best variant again afterwards


def test_a_variant_the_cpu_lacks_is_refused_by_name() -> None:
    with pytest.raises(SystemExit, match="cannot run the avx1024 kernels"):
        bench_variants.main(["--variants", "avx1024", "--turns", "1"])


def test_builds_run_in_processes_of_their_own_with_a_column_each(monkeypatch, tmp_path, capsys) -> None:
    """Two copies of the build, each in its own process running its own file (in one process Python handed back the
    first build's module for the second: every comparison measured the first build twice), both on one core (on two,
    a build read 0.94-0.97x of itself where the guest's cores ran at different speeds)."""
    import shutil

    from engine.native import BUILD_DIR, MODULE_NAME

    monkeypatch.setattr(bench_variants, "TURN_SECONDS", 0.001)
    copies = [str(shutil.copy(BUILD_DIR / f"{MODULE_NAME}.so", tmp_path / f"{name}.so")) for name in ("old", "new")]
    best = available_isas(ops)[0]
    argv = ["--builds", ",".join(copies), "--variants", best, "--rows", "2", "--turns", "1", "--kernels", "q4i8:down"]
    args = argparse.Namespace(kernels="q4i8:down", rows="2")
    processes = [bench_variants.BuildProcess(path, args, [best]) for path in copies]
    try:
        assert [p.module_file for p in processes] == copies and processes[0].turn(0) > 0
    finally:
        for p in processes:
            p.close()
    cores = os.sched_getaffinity(0)
    started_on = []

    class Recorded(bench_variants.BuildProcess):  # the cores a build's process inherits
        def __init__(self, *a) -> None:
            started_on.append(os.sched_getaffinity(0))
            super().__init__(*a)

    monkeypatch.setattr(bench_variants, "BuildProcess", Recorded)
    assert bench_variants.main(argv) == 0
    assert len(started_on) == 2 and started_on[0] == started_on[1] and len(started_on[0]) == 1  # one core for both
    assert os.sched_getaffinity(0) == cores  # given back
    printed = capsys.readouterr().out
    assert f"old.so:{best}" in printed and f"new.so:{best}" in printed
    (figures,) = re.findall(r"^q4i8 down\s+2\s+(.*)$", printed, re.MULTILINE)
    rates, ratio = figures.split()[:2], figures.split()[2:]
    assert all(float(r) > 0 for r in rates) and len(ratio) == 1
