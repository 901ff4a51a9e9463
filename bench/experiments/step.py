"""One native decode step of a real model, per kernel variant and row count: its forward (every layer), its logits, and
the two in one call as the engine runs them.

    python -m bench step [--model PATH] [--rows 1,8,32] [--variants avx512,avx2] [--precision int8] [--calls 200]

Each row is one sequence decoding one token at a position between 60 and 260 of its own (a scattered bf16 paged
cache, as the engine's), so one row is the one-stream decode a server runs, bound by the bytes of weights it reads.
Reports the minimum and median over `--calls` calls. The step column is the one a server sees: timed alone, a head
that fits the last-level cache (the default model's 28 MB) stays there from call to call, where in a step the
layers' weights pass through first (the default model's one row on Zen 4: logits 0.45-0.6 ms alone, 1.17 ms a token
in the engine). This machine's speed drifts by tens of percent over minutes: compare two builds by running them in
turns, not one after the other's whole run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable


def timings(fn: Callable[[], object], calls: int) -> list[float]:
    fn()
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def measure(backend, rows: int, calls: int) -> tuple[list[float], list[float], list[float]]:
    import torch

    from engine.kv_pool import layer_shape

    bs, ctx = 16, 512
    num_blocks = rows * ctx // bs
    shape = layer_shape(backend, num_blocks, bs)
    gen = torch.Generator().manual_seed(0)
    caches = [[torch.randn(shape, generator=gen).bfloat16() * 0.1 for _ in range(backend.num_layers)] for _ in "kv"]
    backend.bind_kv_caches(*caches)
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(rows, ctx // bs)
    positions = torch.randint(60, 260, (rows,), generator=gen)
    ids = torch.randint(0, backend.vocab_size, (rows,), generator=gen)
    slots = tables[torch.arange(rows), positions // bs].long() * bs + positions % bs
    seq_rows = torch.arange(rows, dtype=torch.int32)
    hidden = backend.run_tokens(ids, positions, slots, seq_rows, tables)
    forward = timings(lambda: backend.run_tokens(ids, positions, slots, seq_rows, tables), calls)
    logits = timings(lambda: backend.compute_logits(hidden), calls)
    step = timings(lambda: backend.compute_logits(backend.run_tokens(ids, positions, slots, seq_rows, tables)), calls)
    return forward, logits, step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="a GGUF or Hugging Face folder (default: the default model)")
    parser.add_argument("--rows", default="1,8,32", help="sequences decoding in the step, comma-separated")
    parser.add_argument("--variants", default="best", help="kernel variants, comma-separated (avx512, avxvnni, avx2, baseline)")
    parser.add_argument("--precision", default="int8", choices=("int8", "exact"))
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]

    from bench.kernels import cpu_name
    from engine.config import EngineConfig
    from engine.loader import load_model
    from engine.native import native_ops, use_isa

    ops = native_ops()
    if ops is None:
        print("python -m bench step: the native step is not built (make install builds it)", file=sys.stderr)
        return 2
    loaded = load_model(EngineConfig(model=args.model, precision=args.precision, num_kv_blocks=16, block_size=16))
    backend = loaded.backend
    if not hasattr(backend, "run_tokens"):
        print("python -m bench step: this model runs on the eager path", file=sys.stderr)
        return 2
    print(f"{cpu_name()}; {args.model or 'the default model'}, precision {args.precision}, {args.calls} calls each")
    print("variant   rows  forward min / p50 ms   logits min / p50 ms   step min / p50 ms")
    for variant in args.variants.split(","):
        try:
            use_isa(ops, variant)
            for m in rows:
                columns = measure(backend, m, args.calls)
                print(f"{variant:8s} {m:5d}" + "".join(
                    f"  {min(c) * 1e3:10.2f} / {statistics.median(c) * 1e3:6.2f}" for c in columns))  # fmt: skip
        finally:
            use_isa(ops, "best")
    return 0
