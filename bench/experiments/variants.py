"""Kernel variants in tight turns: the int8 GEMMs of two or more variants of one build, their ratio.

    python -m bench variants [--variants avx2,avxvnni] [--rows 8,32,128] [--turns 30] [--kernels q4i8:gate_up,...]
                             [--builds OLD.so,NEW.so]

Per kernel and row count, the variants take turns of ~20 ms of calls each, `--turns` times, and each keeps its best
per-call time: this guest's speed wanders by tens of percent between minutes (and a whole run of one variant after
another's gave the opposite sign for one kernel), where two variants 20 ms apart meet the same machine. One thread,
timed by its own CPU time. Kernels as `python -m bench kernels` names them (q4i8, q4k, q6 down, q8i8 lm_head: the
default model's shapes); prints G multiply-adds/s per variant and each one's ratio to the first. `--builds` compares
builds of the native extension instead (each file loaded beside the others; a column per build and variant), e.g.
main's engine/native/_build/sluice_native.so copied aside before a change against the changed one.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

SHAPES = {"gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}  # K, N of the default model
DEFAULT_KERNELS = "q4i8:gate_up,q4i8:down,q4k:down,q6:down,q8i8:lm_head"
TURN_SECONDS = 0.02


def load_build(path: str, copy: Path) -> ModuleType:
    """The extension at `path`, loaded from `copy`, a file of its own (one dlopen per file: builds share no code)."""
    shutil.copy(path, copy)
    spec = importlib.util.spec_from_file_location("sluice_native", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def best_in_turns(columns: list[tuple[ModuleType, str, Callable[[], object]]], turns: int) -> list[float]:
    """Each column's (build, variant, call) best seconds per call over `turns` turns of TURN_SECONDS each, the
    columns alternating."""
    from engine.native import use_isa

    best = [float("inf")] * len(columns)
    try:
        for _ in range(turns):
            for i, (ops, variant, run) in enumerate(columns):
                use_isa(ops, variant)
                run()
                calls, start = 0, time.thread_time()
                while (elapsed := time.thread_time() - start) < TURN_SECONDS:
                    run()
                    calls += 1
                best[i] = min(best[i], elapsed / max(calls, 1))
    finally:
        for ops, _, _ in columns:
            use_isa(ops, "best")
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="", help="comma-separated (default: every one this CPU runs)")
    parser.add_argument("--rows", default="8,32,128", help="GEMM row counts, comma-separated")
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--kernels", default=DEFAULT_KERNELS, help="kind:shape pairs, comma-separated")
    parser.add_argument("--builds", default="", help="native extension files to compare, comma-separated")
    args = parser.parse_args(argv)

    from bench.kernels import cpu_name, packed_gemm
    from engine.native import available_isas, native_ops

    ops = native_ops()
    if ops is None:
        print("python -m bench variants: the native step is not built (make install builds it)", file=sys.stderr)
        return 2
    runnable = available_isas(ops)
    variants = args.variants.split(",") if args.variants else runnable
    if missing := [v for v in variants if v not in runnable]:
        raise SystemExit(f"this CPU cannot run the {', '.join(missing)} kernels (it can run: {', '.join(runnable)})")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [b for b in args.builds.split(",") if b]
        builds = [(Path(b).name, load_build(b, Path(tmp) / f"{i}.so")) for i, b in enumerate(paths)] or [("", ops)]
        labels = [f"{name}:{v}" if name else v for name, _ in builds for v in variants]
        print(f"{cpu_name()}; one thread, CPU time; {args.turns} turns of {TURN_SECONDS * 1e3:.0f} ms per column")
        print(f"{'kernel':16s} rows " + " ".join(f"{c:>9s}" for c in labels) + "  (G multiply-adds/s; ratio to the first)")
        gen = torch.Generator().manual_seed(1)
        for spec in args.kernels.split(","):
            kind, shape = spec.split(":")
            k, n = SHAPES[shape]
            w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05
            runs = [(build, packed_gemm(build, kind, w)[0]) for _, build in builds]
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=gen)
                columns = [(build, v, (lambda r: lambda: r(x))(run)) for build, run in runs for v in variants]
                rates = [m * k * n / s / 1e9 for s in best_in_turns(columns, args.turns)]
                ratios = " ".join(f"{r / rates[0]:.2f}x" for r in rates[1:])
                print(f"{kind + ' ' + shape:16s} {m:4d} " + " ".join(f"{r:9.1f}" for r in rates) + f"  {ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
