"""Sluice's GEMMs against ggml's own (llama.cpp's CPU backend), the same weight types and shapes, one core.

    python -m bench ggml --test-backend-ops avx512=../peers/test-backend-ops,avx2=../peers/test-backend-ops-avx2
                         [--types q4_1,q4_K,q6_K,q8_0] [--rows 1,8,512]

llama.cpp's `test-backend-ops perf -o MUL_MAT` times ggml's matrix multiply of a weight type by float32 activations
(which ggml quantises to its Q8 types first, as Sluice's int8 kernels quantise theirs) at m = 4096 outputs, k = 14336
inputs, n = 1, 8 and 512 rows, on half the cores (one here). Each binary named here (`make llama-server` builds it
beside llama-server, `PEER_ISA=avx2` its AVX2 build) runs pinned to one core, then Sluice's kernel of the same
type, instruction-set variant and shape on that core, timed by its CPU time. Prints G multiply-adds/s of both, the
ratio, and Sluice's share of its variant's measured int8 peak (bench.kernels' register-only loop) with ggml's share
of the same peak. ggml's plain CPU path only: llama-server repacks some types (Q4_0, IQ4_NL, Q4_K on AVX2) into
interleaved rows that this tool does not time; the model-level comparisons (bench load, llama-bench) include them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import types

M_OUT, K_IN = 4096, 14336  # test-backend-ops' MUL_MAT perf shape
# ggml's weight type -> bench.kernels' kind of the same type in Sluice's layout, int8 activations
KIND_OF_TYPE = {
    "q4_0": "q4i8", "q4_1": "q4i8", "q4_K": "q4k", "q5_0": "q5", "q5_K": "q5k", "q6_K": "q6", "q8_0": "q8li8",
}  # fmt: skip
GFLOPS = re.compile(r"MUL_MAT\(type_a=(\w+),type_b=f32,m=(\d+),n=(\d+),k=(\d+),.*?([\d.]+) GFLOPS")


def ggml_rates(binary: str, types_: list[str], rows: list[int], core: int) -> dict[tuple[str, int], float]:
    """(type, rows) -> multiply-adds/s of ggml's MUL_MAT at M_OUT x K_IN, the binary pinned to `core`."""
    pattern = f"type_a=({'|'.join(types_)}),type_b=f32,m={M_OUT},n=({'|'.join(map(str, rows))}),k={K_IN},"
    run = subprocess.run(["taskset", "-c", str(core), binary, "perf", "-b", "CPU", "-o", "MUL_MAT", "-p", pattern],
                         capture_output=True, text=True, check=True)  # fmt: skip
    rates = {}
    for type_name, m, n, k, gflops in GFLOPS.findall(re.sub(r"\x1b\[[0-9;]*m", "", run.stdout)):
        if (int(m), int(k)) == (M_OUT, K_IN):
            rates[(type_name, int(n))] = float(gflops) * 1e9 / 2
    return rates


def sluice_rates(
    variant: str, types_: list[str], rows: list[int], quick: bool
) -> tuple[dict[tuple[str, int], float], float]:
    """(type, rows) -> Sluice's multiply-adds/s on `variant`, one thread timed by its CPU time; and the int8 peak."""
    import torch

    from bench import kernels
    from engine.native import native_ops, use_isa

    ops = native_ops()
    threads, clock = torch.get_num_threads(), kernels.CLOCK
    torch.set_num_threads(1)
    kernels.CLOCK = time.thread_time
    try:
        use_isa(ops, variant)
        peaks = kernels.measure_peaks(ops, quick)
        opts = types.SimpleNamespace(repeats=1 if quick else 3, min_seconds=0.0 if quick else 0.3, quick=quick)
        rates = {}
        for type_name in types_:
            shape = kernels.Shape(type_name, K_IN, M_OUT, KIND_OF_TYPE[type_name])
            for row in kernels.gemm_rows(ops, variant, shape, rows, peaks, opts):
                rates[(type_name, row.rows)] = row.rate
    finally:  # as it was: the caller's (a test run's) threads and clock
        use_isa(ops, "best")
        torch.set_num_threads(threads)
        kernels.CLOCK = clock
    return rates, peaks.madds_int8


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    binaries_help = "variant=path pairs, comma-separated: llama.cpp's test-backend-ops built for that ISA"
    parser.add_argument("--test-backend-ops", required=True, help=binaries_help)
    parser.add_argument("--types", default="q4_1,q4_K,q6_K,q8_0", help=f"of {', '.join(KIND_OF_TYPE)}")
    parser.add_argument("--rows", default="1,8,512", help="of 1, 8, 512 (test-backend-ops' own)")
    parser.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # the tests': one short round
    args = parser.parse_args(argv)
    types_ = args.types.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    if unknown := [t for t in types_ if t not in KIND_OF_TYPE]:
        parser.error(f"unknown type {', '.join(unknown)} (known: {', '.join(KIND_OF_TYPE)})")
    binaries = dict(pair.split("=", 1) for pair in args.test_backend_ops.split(","))
    from bench.kernels import cpu_name
    from engine.native import available_isas, native_ops

    if missing := [v for v in binaries if v not in available_isas(native_ops())]:
        parser.error(f"this CPU cannot run the {', '.join(missing)} kernels")
    cores = os.sched_getaffinity(0)
    core = max(cores)
    os.sched_setaffinity(0, {core})
    try:
        print(f"{cpu_name()}; one core (CPU {core}); m = {M_OUT} outputs, k = {K_IN} inputs; G multiply-adds/s")
        print(f"{'variant':8} {'type':6} {'rows':>5} {'ggml':>8} {'Sluice':>8} {'ratio':>6} {'ggml % peak':>12} "
              f"{'Sluice % peak':>14}")  # fmt: skip
        for variant, binary in binaries.items():
            theirs = ggml_rates(binary, types_, rows, core)
            ours, peak = sluice_rates(variant, types_, rows, args.quick)
            for type_name in types_:
                for n in rows:
                    g, s = theirs.get((type_name, n)), ours[(type_name, n)]
                    g_text = f"{g / 1e9:8.1f}" if g else f"{'-':>8}"
                    ratio = f"{s / g:5.2f}x" if g else f"{'-':>6}"
                    g_pct = f"{100 * g / peak:11.0f}%" if g else f"{'-':>12}"
                    ours_text = f"{s / 1e9:8.1f} {ratio} {g_pct} {100 * s / peak:13.0f}%"
                    print(f"{variant:8} {type_name:6} {n:5} {g_text} {ours_text}")
    finally:  # the caller's cores again (a test run's other tests must not run on one)
        os.sched_setaffinity(0, cores)
    return 0


if __name__ == "__main__":
    sys.exit(main())
