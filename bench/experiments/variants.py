"""Kernel variants in tight turns: the int8 GEMMs of two or more variants of one build, their ratio.

    python -m bench variants [--variants avx2,avxvnni] [--rows 8,32,128] [--turns 30] [--kernels q4i8:gate_up,...]
                             [--builds OLD.so,NEW.so]

Per kernel and row count, the variants take turns of ~20 ms of calls each, `--turns` times, and each keeps its best
per-call time: this guest's speed wanders by tens of percent between minutes (and a whole run of one variant after
another's gave the opposite sign for one kernel), where two variants 20 ms apart meet the same machine. One thread,
timed by its own CPU time. Kernels as `python -m bench kernels` names them (q4i8, q4k, q6 down, q8i8 lm_head: the
default model's shapes); prints G multiply-adds/s per variant and each one's ratio to the first. `--builds` compares
builds of the native extension instead (a column per build and variant), e.g. main's
engine/native/_build/sluice_native.so copied aside before a change against the changed one: each build runs in a
process of its own, which takes its turns when this one names them. (Loaded side by side in one process, every build
was the first: Python handed back the module it had already made for the name "sluice_native".) Every process is
pinned to one core: unpinned, the same build in two processes read 0.94-0.97x of itself on a Zen 4 guest whose two
vCPUs ran at different speeds, and pinned 1.00x.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

SHAPES = {"gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}  # K, N of the default model
DEFAULT_KERNELS = "q4i8:gate_up,q4i8:down,q4k:down,q6:down,q8i8:lm_head"
TURN_SECONDS = 0.02


def load_build(path: str) -> ModuleType:
    """The extension at `path` (in a process of its own: see the module's docstring)."""
    spec = importlib.util.spec_from_file_location("sluice_native", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_turn(ops: ModuleType, variant: str, run: Callable[[], object], seconds: float) -> float:
    """Seconds per call of `run` on `variant`'s kernels over one turn of `seconds` of this thread's CPU time."""
    from engine.native import use_isa

    use_isa(ops, variant)
    try:
        run()
        calls, start = 0, time.thread_time()
        while (elapsed := time.thread_time() - start) < seconds:
            run()
            calls += 1
        return elapsed / max(calls, 1)
    finally:
        use_isa(ops, "best")


def columns_of(ops: ModuleType, kernels: str, rows: list[int], variants: list[str]) -> list[tuple[str, int, Callable]]:
    """(kernel, rows, call) per kernel, row count and variant, in the order the turns name them."""
    from bench.kernels import packed_gemm

    columns = []
    for spec in kernels.split(","):
        kind, shape = spec.split(":")
        k, n = SHAPES[shape]
        run = packed_gemm(ops, kind, torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05)[0]
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            columns += [(spec, m, (lambda run, x: lambda: run(x))(run, x)) for _ in variants]
    return columns


def serve_turns(path: str, kernels: str, rows: list[int], variants: list[str], seconds: float) -> None:
    """A build's process under --builds: reads a column's index a line, runs its turn, writes its seconds a call."""
    ops = load_build(path)
    torch.set_num_threads(1)
    columns = columns_of(ops, kernels, rows, variants)
    print("ready", ops.__file__, flush=True)
    for line in sys.stdin:
        i = int(line)
        print(one_turn(ops, variants[i % len(variants)], columns[i][2], seconds), flush=True)


class BuildProcess:
    """One build's process under --builds (serve_turns): started, checked to run its own file, asked for turns."""

    def __init__(self, path: str, args: argparse.Namespace, variants: list[str]) -> None:
        argv = [sys.executable, "-m", "bench.experiments.variants", "--serve-build", path, "--kernels", args.kernels,
                "--rows", args.rows, "--variants", ",".join(variants), "--turn-seconds", str(TURN_SECONDS)]  # fmt: skip
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready, _, self.module_file = self.process.stdout.readline().strip().partition(" ")
        if ready != "ready" or Path(self.module_file).resolve() != Path(path).resolve():
            self.close()
            raise SystemExit(f"python -m bench variants: the build {path} did not start ({ready} {self.module_file})")

    def turn(self, index: int) -> float:
        self.process.stdin.write(f"{index}\n")
        self.process.stdin.flush()
        if not (line := self.process.stdout.readline()):
            raise SystemExit("python -m bench variants: a build's process ended (its error is above)")
        return float(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(30)


def best_in_turns(turns_of: list[Callable[[], float]], turns: int) -> list[float]:
    """Each column's best seconds per call over `turns` turns, the columns alternating."""
    best = [float("inf")] * len(turns_of)
    for _ in range(turns):
        for i, turn in enumerate(turns_of):
            best[i] = min(best[i], turn())
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="", help="comma-separated (default: every one this CPU runs)")
    parser.add_argument("--rows", default="8,32,128", help="GEMM row counts, comma-separated")
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--kernels", default=DEFAULT_KERNELS, help="kind:shape pairs, comma-separated")
    parser.add_argument("--builds", default="", help="native extension files to compare, comma-separated")
    parser.add_argument("--serve-build", default="", help=argparse.SUPPRESS)  # a build's own process
    parser.add_argument("--turn-seconds", type=float, default=TURN_SECONDS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if args.serve_build:
        serve_turns(args.serve_build, args.kernels, rows, args.variants.split(","), args.turn_seconds)
        return 0

    from bench.kernels import cpu_name
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
    cores = os.sched_getaffinity(0)
    core = max(cores)
    os.sched_setaffinity(0, {core})  # the builds' processes inherit it
    paths = [b for b in args.builds.split(",") if b]
    builds: list[BuildProcess] = []
    try:
        for path in paths:
            builds.append(BuildProcess(path, args, variants))
        labels = [f"{Path(p).name}:{v}" for p in paths for v in variants] or variants
        print(f"{cpu_name()}; one thread on core {core}, CPU time; {args.turns} turns of {TURN_SECONDS * 1e3:.0f} ms per column")
        print(f"{'kernel':16s} rows " + " ".join(f"{c:>9s}" for c in labels) + "  (G multiply-adds/s; ratio to the first)")
        columns = [] if builds else columns_of(ops, args.kernels, rows, variants)
        for group, spec_m in enumerate((spec, m) for spec in args.kernels.split(",") for m in rows):
            first = group * len(variants)
            if builds:
                turns_of = [(lambda b, i: lambda: b.turn(i))(b, first + j) for b in builds for j in range(len(variants))]
            else:
                turns_of = [(lambda v, run: lambda: one_turn(ops, v, run, TURN_SECONDS))(v, columns[first + j][2])
                            for j, v in enumerate(variants)]  # fmt: skip
            (kind, shape), m = spec_m[0].split(":"), spec_m[1]
            k, n = SHAPES[shape]
            rates = [m * k * n / s / 1e9 for s in best_in_turns(turns_of, args.turns)]
            ratios = " ".join(f"{r / rates[0]:.2f}x" for r in rates[1:])
            print(f"{kind + ' ' + shape:16s} {m:4d} " + " ".join(f"{r:9.1f}" for r in rates) + f"  {ratios}")
    finally:
        for b in builds:
            b.close()
        os.sched_setaffinity(0, cores)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
