"""The native kernels on this CPU, per instruction-set variant, against this CPU's measured peaks.

    python -m bench kernels [--variants avx2,baseline] [--rows 1,8,32,128,512] [--markdown] [--quick]

For each variant the CPU can run (engine/native: avx512, avxvnni, avx2, baseline; SLUICE_ISA forces one in the server):
- peaks: the GEMMs' integer multiply-add in a register-only loop on every thread (multiply-adds/s), for the int16
  kernels' instruction and for the int8 kernels' (vpdpbusd, pmaddubsw), and a streaming read of 256 MiB (bytes/s);
- the Q4_1 GEMM at the default model's shapes (gate_up 576 -> 3072, down 1536 -> 576) with int16 activations
  ("q4", precision "exact") and int8 ones ("q4i8", precision "int8", against the int8 peak), the down projection
  in the layouts of a downloaded file's other types ("q4f": float32 scales, "q8l": Q8_0, with int16
  activations; "q8li8": Q8_0, "q4k": Q4_K's own 6-bit scales per super-block, "q5" / "q5k": Q5_0 / Q5_K in the Q5
  layout, "q6": Q6_K, with int8 activations; gate_up in "q5" too), the
  Q8_0 lm_head (576 -> 49152), for each row count: multiply-adds/s and % of the arithmetic peak, weight bytes/s
  and % of the read bandwidth (one row is a decode: it should be bound by memory, many rows by arithmetic);
- decode attention: one query token per sequence at position 512 over a scattered bf16 paged cache (9 query
  heads, 3 KV heads, head dim 64): tokens/s and KV bytes/s;
- a prefill chunk: one layer of the default model's shape over a 256-token chunk (its linears and attention), with
  int16 ("exact") and int8 activations (% of the peak: the linears' multiply-adds against that precision's), and
  the same int8 chunk after 2048 tokens of its prompt (a long prompt's later chunk, where attention dominates).

Wall times on all of torch's threads, the best of a few repeats (a shared machine only makes it slower);
`--per-core` instead runs one thread and times it by its own CPU time, which a machine shared with other work
disturbs far less (the peaks are then per core too). `--quick` runs small shapes with one repeat in a few seconds:
the CI smoke test, which asserts no timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

DEFAULT_ROWS = (1, 8, 32, 128, 512)
INT8_KINDS = ("q4i8", "q4k", "q5", "q5k", "q6", "q8li8", "q8i8")  # the kinds measured with int8 activations
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 576, 1536, 9, 3, 64, 49152  # SmolLM2-135M


@dataclass
class Shape:
    name: str
    k: int
    n: int
    # "q4" (int16 activations), "q4i8" (int8 activations: precision "int8"), "q4f" (the Q4 layout with float32
    # scales), "q8l" (the Q8 layer layout: Q8_0 layers) or "q8li8" (the same, int8), "q4k" (Q4_K's super-block
    # scales, int8), "q5" / "q5k" (Q5_0 / Q5_K in the Q5 layout, int8), "q6" (Q6_K, int8), "q8" (the lm_head) or
    # "q8i8" (the lm_head in precision "int8")
    kind: str


@dataclass
class Peaks:
    madds: float  # multiply-adds/s of the int16 kernels' instruction, register-only, every thread
    madds_int8: float  # the same for the int8 kernels' instruction
    read_bytes: float  # bytes/s of a streaming read

    def madds_for(self, kind: str) -> float:
        return self.madds_int8 if kind in INT8_KINDS else self.madds


@dataclass
class Row:
    variant: str
    what: str
    rows: int
    seconds: float
    rate: float  # multiply-adds/s (GEMM) or tokens/s (attention, prefill)
    rate_pct: float | None  # of the arithmetic peak
    bytes_per_s: float
    bytes_pct: float | None  # of the streaming-read bandwidth


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            pairs = [line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line]
        info = {key.strip(): value.strip() for key, value in pairs}
        return f"{info['model name']} (family {info['cpu family']}, model {info['model']})"
    except (OSError, KeyError):
        return platform.processor() or "unknown CPU"


CLOCK = time.perf_counter  # time.thread_time with --per-core


def best_time(fn: Callable[[], object], repeats: int, min_seconds: float) -> float:
    """Best per-call time over `repeats` rounds of at least `min_seconds` each."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        calls, start = 0, CLOCK()
        while True:
            fn()
            calls += 1
            elapsed = CLOCK() - start
            if elapsed >= min_seconds:
                break
        best = min(best, elapsed / calls)
    return best


def measure_peaks(ops, quick: bool) -> Peaks:
    """The register-only loops' multiply-adds/s (int16 and int8 instructions) and a streaming read's bytes/s."""
    iterations = 200_000 if quick else 5_000_000

    def madds(is_int8: bool) -> float:
        best = float("inf")
        for _ in range(1 if quick else 3):
            start = CLOCK()
            macs = ops.madd_peak(iterations, is_int8)
            best = min(best, CLOCK() - start)
        return macs / best

    data = torch.ones((16 if quick else 256) << 18)  # 16 or 256 MiB of float32
    seconds = best_time(lambda: ops.read_stream(data), 1 if quick else 3, 0.0 if quick else 0.5)
    return Peaks(madds(False), madds(True), data.numel() * 4 / seconds)


K_QUANT_TYPES = {"q4k": "Q4_K", "q5": "Q5_0", "q5k": "Q5_K", "q6": "Q6_K"}  # kinds packed from a file type's blocks


def packed_layer(kind: str, w: torch.Tensor):
    """w [N, K] in the layer layout `kind` measures; float32 scales for "q4f" (scales float16 cannot hold)."""
    from engine.native.packing import pack_q4, pack_q4_grid, pack_q6_grid, pack_q8_layer_grid, q4_grid, q8_grid

    if kind in K_QUANT_TYPES:  # random blocks of the file type (the speed does not depend on the values)
        import numpy as np

        from bench.synthetic_gguf import random_blocks
        from engine.checkpoint.block_grids import grid_of
        from engine.checkpoint.stored_tensor import StoredTensor

        n, k = w.shape
        type_name = K_QUANT_TYPES[kind]
        grid = grid_of(StoredTensor((n, k), type_name, lambda: random_blocks(np.random.default_rng(0), type_name, n, k)))
        q = torch.from_numpy(grid.q)
        if kind == "q6":
            return pack_q6_grid(q, grid.factors, None)
        scale, minv = torch.from_numpy(grid.scale), torch.from_numpy(grid.minv)
        return pack_q4_grid(q, scale, minv, None, grid.factors, has_fifth_bits=kind in ("q5", "q5k"))
    if kind == "q4f":
        q, scale, minv = q4_grid(w)
        return pack_q4_grid(q, scale * (1 + 2.0**-15), minv, None)
    if kind in ("q8l", "q8li8"):
        return pack_q8_layer_grid(*q8_grid(w), None, None)
    return pack_q4(w, None)


def packed_gemm(ops, kind: str, w: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """w [N, K] packed as `kind` (see Shape): the call that multiplies rows of activations by it, and its weight
    bytes."""
    from engine.native.packing import linear_spec, pack_q8

    n = w.shape[0]
    if kind in ("q8", "q8i8"):
        p8 = pack_q8(w)
        weight_bytes = p8.qs.numel() + p8.scale.numel() * 2
        return (lambda x: ops.q8_linear(x, p8.qs, p8.scale, n, is_int8=kind == "q8i8")), weight_bytes
    p = packed_layer(kind, w)
    weight_bytes = sum(t.numel() * t.element_size() for t in p.tensors() if t is not p.bias)
    return (lambda x: ops.linear(x, linear_spec(p), n, is_int8=kind in INT8_KINDS)), weight_bytes


def gemm_rows(ops, variant: str, shape: Shape, rows: list[int], peaks: Peaks, opts) -> list[Row]:
    gen = torch.Generator().manual_seed(0)
    run, weight_bytes = packed_gemm(ops, shape.kind, torch.randn(shape.n, shape.k, generator=gen) * 0.05)
    out = []
    for m in rows:
        x = torch.randn(m, shape.k, generator=gen)
        seconds = best_time(lambda: run(x), opts.repeats, opts.min_seconds)
        rate = m * shape.k * shape.n / seconds
        out.append(Row(variant, f"{shape.kind} {shape.name} {shape.k}->{shape.n}", m, seconds, rate,
                       100 * rate / peaks.madds_for(shape.kind), weight_bytes / seconds,
                       100 * weight_bytes / seconds / peaks.read_bytes))  # fmt: skip
    return out


def attention_rows(ops, variant: str, rows: list[int], peaks: Peaks, opts) -> list[Row]:
    """Decode attention: `m` sequences, one query each, `length` keys each, blocks scattered over the cache."""
    length, block = (64, 16) if opts.quick else (512, 16)
    blocks_per_seq = length // block
    out = []
    for m in rows:
        if m > 128:
            continue  # a decode batch of more than 128 sequences is not a case the server meets
        num_blocks = m * blocks_per_seq
        gen = torch.Generator().manual_seed(1)
        k = torch.randn(num_blocks, KV_HEADS, block, HEAD_DIM, generator=gen).bfloat16()  # the step's layout
        v = torch.randn(num_blocks, KV_HEADS, block, HEAD_DIM, generator=gen).bfloat16()
        tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(m, blocks_per_seq)
        q = torch.randn(m, HEADS, HEAD_DIM, generator=gen)
        lengths = torch.full((m,), length, dtype=torch.int64)
        seconds = best_time(lambda: ops.attention(q, k, v, tables, lengths), opts.repeats, opts.min_seconds)
        kv_bytes = 2 * m * length * KV_HEADS * HEAD_DIM * 2
        out.append(Row(variant, f"decode attention L={length} bf16", m, seconds, m / seconds, None,
                       kv_bytes / seconds, 100 * kv_bytes / seconds / peaks.read_bytes))  # fmt: skip
    return out


def prefill_chunk_row(ops, variant: str, peaks: Peaks, opts, precision: str, start: int = 0) -> Row:
    """One layer of the default model's shape over one prompt's chunk of `chunk` tokens (positions start ..
    start + chunk - 1: a long prompt's later chunk attends to every earlier token too), its linears' activations
    in `precision` ("exact": int16, "int8")."""
    from engine.native.packing import LinearSpec, linear_spec, pack_q4, pack_q8

    chunk, block, vocab = (32, 16, 256) if opts.quick else (256, 16, 1024)
    gen = torch.Generator().manual_seed(2)

    def q4(n: int, k: int) -> LinearSpec:
        return linear_spec(pack_q4(torch.randn(n, k, generator=gen) * 0.05, None))

    embed = pack_q8(torch.randn(vocab, HIDDEN, generator=gen) * 0.05)
    length = start + chunk
    positions = torch.arange(length, dtype=torch.float32)[:, None]
    freqs = positions * (10000.0 ** (-torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = torch.cat([freqs, freqs], dim=1)
    sin = torch.cat([-angles[:, : HEAD_DIM // 2].sin(), angles[:, HEAD_DIM // 2 :].sin()], dim=1).contiguous()
    model = ops.NativeLlama(HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, 1e-5, vocab, embed.qs, embed.scale,
                            embed.qs, embed.scale, torch.ones(HIDDEN), angles.cos().contiguous(), sin)  # fmt: skip
    model.add_layer(torch.ones(HIDDEN), torch.ones(HIDDEN), q4((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
                    q4(HIDDEN, HEADS * HEAD_DIM), q4(2 * INTERMEDIATE, HIDDEN), q4(HIDDEN, INTERMEDIATE))  # fmt: skip
    model.set_precision(precision)
    num_blocks = length // block
    cache = [torch.zeros(num_blocks, KV_HEADS, block, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2)]
    model.set_kv_caches([cache[0]], [cache[1]])
    ids = torch.randint(0, vocab, (chunk,), generator=gen)
    pos = torch.arange(start, length)
    rows = torch.zeros(chunk, dtype=torch.int32)
    tables = torch.arange(num_blocks, dtype=torch.int32)[None]
    seconds = best_time(lambda: model.forward(ids, pos, pos, rows, tables), opts.repeats, opts.min_seconds)
    linear_macs = chunk * HIDDEN * ((HEADS + 2 * KV_HEADS) * HEAD_DIM + 3 * INTERMEDIATE) + chunk * HEADS * HEAD_DIM * HIDDEN
    peak = peaks.madds_int8 if precision == "int8" else peaks.madds
    at = f" after {start}" if start else ""
    return Row(variant, f"prefill chunk {chunk} tok{at}, 1 layer, {precision}", chunk, seconds, chunk / seconds,
               100 * linear_macs / seconds / peak, 0.0, None)  # fmt: skip


def run_variant(ops, variant: str, rows: list[int], opts) -> tuple[Peaks, list[Row]]:
    from engine.native import use_isa

    use_isa(ops, variant)
    try:
        peaks = measure_peaks(ops, opts.quick)
        if opts.quick:
            shapes = [Shape("small", 64, 96, kind) for kind in ("q4", "q4i8", "q4f", "q8l", "q8li8", "q8", "q8i8")]
            shapes += [Shape("small", 256, 96, kind) for kind in K_QUANT_TYPES]  # K-quants: K in super-blocks of 256
        else:
            shapes = [Shape("gate_up", HIDDEN, 2 * INTERMEDIATE, "q4"), Shape("down", INTERMEDIATE, HIDDEN, "q4"),
                      Shape("gate_up", HIDDEN, 2 * INTERMEDIATE, "q4i8"), Shape("down", INTERMEDIATE, HIDDEN, "q4i8"),
                      Shape("down", INTERMEDIATE, HIDDEN, "q4f"), Shape("down", INTERMEDIATE, HIDDEN, "q8l"),
                      Shape("down", INTERMEDIATE, HIDDEN, "q8li8"), Shape("down", INTERMEDIATE, HIDDEN, "q4k"),
                      Shape("down", INTERMEDIATE, HIDDEN, "q6"), Shape("gate_up", HIDDEN, 2 * INTERMEDIATE, "q5"),
                      Shape("down", INTERMEDIATE, HIDDEN, "q5"), Shape("down", INTERMEDIATE, HIDDEN, "q5k"),
                      Shape("lm_head", HIDDEN, VOCAB, "q8"), Shape("lm_head", HIDDEN, VOCAB, "q8i8")]  # fmt: skip
        results = []
        for shape in shapes:
            results += gemm_rows(ops, variant, shape, rows, peaks, opts)
        results += attention_rows(ops, variant, rows, peaks, opts)
        results += [prefill_chunk_row(ops, variant, peaks, opts, precision) for precision in ("exact", "int8")]
        results.append(prefill_chunk_row(ops, variant, peaks, opts, "int8", start=64 if opts.quick else 2048))
        return peaks, results
    finally:
        use_isa(ops, "best")


def show(variant: str, peaks: Peaks, rows: list[Row], markdown: bool) -> None:
    print(f"\n{variant}: register-only multiply-add peak {peaks.madds / 1e9:.1f} G/s (int8: {peaks.madds_int8 / 1e9:.1f}), "
          f"streaming read {peaks.read_bytes / 1e9:.1f} GB/s; q4 = int16 activations, q4i8 = int8, "
          f"q4f = float32 scales, q8l = the Q8 layer layout (Q8_0); int8: q8li8 = the same, q4k = Q4_K's own "
          f"scales, q5 / q5k = Q5_0 / Q5_K (the Q5 layout), q6 = Q6_K, q8i8 = the lm_head")
    header = ["kernel", "rows", "ms", "rate", "% peak", "GB/s", "% bandwidth"]
    lines = []
    for r in rows:
        rate = f"{r.rate / 1e9:.2f} GMAC/s" if "->" in r.what else f"{r.rate:.0f} tok/s"
        lines.append([r.what, str(r.rows), f"{r.seconds * 1e3:.3f}", rate,
                      "" if r.rate_pct is None else f"{r.rate_pct:.0f}%", f"{r.bytes_per_s / 1e9:.1f}",
                      "" if r.bytes_pct is None else f"{r.bytes_pct:.0f}%"])  # fmt: skip
    if markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for line in lines:
            print("| " + " | ".join(line) + " |")
        return
    widths = [max(len(x) for x in col) for col in zip(header, *lines)]
    for line in [header, *lines]:
        print("  ".join(x.ljust(w) for x, w in zip(line, widths)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", help="comma-separated: avx512, avxvnni, avx2, baseline (default: every one this CPU runs)")
    p.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)), help="GEMM row counts (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-seconds", type=float, default=0.2, help="shortest timed round per measurement")
    p.add_argument("--per-core", action="store_true", help="one thread, timed by its CPU time (for a shared machine)")
    p.add_argument("--quick", action="store_true", help="small shapes, one short round: a smoke test in seconds")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", help="write every figure to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.min_seconds = 1, 0.0
    return args


def main(argv: list[str] | None = None) -> int:
    from engine.native import ISA_VARIANTS, available_isas, native_ops

    global CLOCK
    args = parse_args(argv)
    if args.per_core:
        torch.set_num_threads(1)
        CLOCK = time.thread_time
    ops = native_ops()
    if ops is None:
        print("the native step is not built (make install builds it): nothing to measure")
        return 1
    runnable = available_isas(ops)
    variants = args.variants.split(",") if args.variants else runnable
    missing = [v for v in variants if v not in runnable]
    if missing:
        raise SystemExit(f"this CPU cannot run the {', '.join(missing)} kernels (it can run: {', '.join(runnable)})")
    rows = [int(r) for r in args.rows.split(",")]
    clock = "per core, thread CPU time" if args.per_core else "wall time"
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads ({clock}); variants: {', '.join(variants)}"
          f" (not runnable here: {', '.join(v for v in ISA_VARIANTS if v not in runnable) or 'none'})")
    report = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "variants": {}}
    for variant in variants:
        peaks, results = run_variant(ops, variant, rows, args)
        show(variant, peaks, results, args.markdown)
        report["variants"][variant] = {"madd_peak": peaks.madds, "madd_peak_int8": peaks.madds_int8,
                                       "read_bandwidth": peaks.read_bytes,
                                       "results": [asdict(r) for r in results]}  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
