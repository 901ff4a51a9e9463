"""The native step (engine/native): kernels against float references, the whole step against transformers,
greedy output independent of batch composition, and the eager fallback.

Tolerances: the native step computes from the weights' own Q4_1 / Q8_0 grids, with the layers' activations
rounded to int16 per group of 32 (exact integer dot products) and float32 elsewhere. On a model whose weights
lie on those grids (the GGUF default model; grid_llama_dir here) its logits stay within 1e-3 of the largest
logit of the float32 reference with a float32 KV cache, 2e-2 with a bfloat16 one (the default dtype)."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from bench.kernels import packed_layer
from bench.synthetic_gguf import random_blocks
from engine import LLM, SamplingParams
from engine.checkpoint.block_grids import grid_of
from engine.checkpoint.stored_tensor import StoredTensor
from engine.config import EngineConfig
from engine.kv_pool import blocks_of
from engine.model_runner import ModelRunner
import engine.native as engine_native
from engine.loader import load_model
from engine.native import native_ops
from engine.native.packing import (
    INT8_STEPS,
    INT16_STEPS,
    can_pack_q4_exactly,
    dequantize_q4,
    dequantize_q8,
    linear_spec,
    pack_q4,
    pack_q4_grid,
    pack_q6_grid,
    pack_q8,
    pack_q8_layer_grid,
    q4_grid_reference,
    q4_reference,
    q8_layer_reference,
    q8_reference,
)

from tests.support.engine_helpers import hf_greedy
from tests.support.runner_parity import BLOCK_SIZE, ParityRun, RecordingSampler
from tests.support.tiny_models import GEMMA3_WINDOW, save_tiny_gemma3, save_tiny_llama, save_tiny_qwen3

ops = native_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the native step is not built (make install builds it)")
ISAS = ["avx512", "avxvnni", "avx2", "base"]
SIMD_ISAS = ("avx512", "avxvnni", "avx2")  # FMA: the same bits in every one (baseline rounds apart)


def available_isas() -> list[str]:
    found = []
    for isa in ISAS:
        try:
            ops.set_isa(isa)
            found.append(isa)
        except RuntimeError:
            pass
    ops.set_isa("best")
    return found


@contextmanager
def on_isa(isa: str) -> Iterator[None]:
    """The kernels of variant `isa` inside (the test is skipped where this CPU lacks it), the best ones after."""
    if isa not in available_isas():
        pytest.skip(f"this CPU has no {isa}")
    ops.set_isa(isa)
    try:
        yield
    finally:
        ops.set_isa("best")


def on_native_grids(path: Path) -> Path:
    """Move a saved model's matrices onto the native grids (as a GGUF's weights are): Q4_1 for the layers'
    linears, Q8_0 for the embedding and lm_head."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    for name, t in tensors.items():
        if t.dim() != 2:
            continue
        tensors[name] = (dequantize_q8(t) if "embed" in name or "lm_head" in name else dequantize_q4(t)).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def grid_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama on the native grids. Hidden size 128 so that the head dim (32) and every K are whole
    groups."""
    return on_native_grids(save_tiny_llama(tmp_path_factory.mktemp("grid_llama"), hidden_size=128, intermediate_size=256))


# the Llama family's variants the native step runs through options: tiny random models on the native grids
GRID_ARCHS = {"qwen3": save_tiny_qwen3, "gemma3": save_tiny_gemma3}


@pytest.fixture(scope="module", params=sorted(GRID_ARCHS))
def grid_variant_dir(request, tmp_path_factory) -> Path:
    return on_native_grids(GRID_ARCHS[request.param](tmp_path_factory.mktemp(f"grid_{request.param}")))


@pytest.mark.parametrize("isa", ISAS)
def test_q4_and_q8_kernels_match_float_references_and_rows_are_independent(isa: str) -> None:
    with on_isa(isa):
        gen = torch.Generator().manual_seed(0)
        for n, k in [(64, 32), (100, 64), (576, 576), (200, 1536)]:
            w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
            q4, q8 = pack_q4(w, b), pack_q8(w)
            for m in (1, 7, 8, 33):
                x = torch.randn(m, k, generator=gen)
                y = ops.linear(x, linear_spec(q4), n)
                # int8 activations: exact integer dot products, float32 scaling
                torch.testing.assert_close(y.double(), q4_reference(x, w) + b.double(), atol=2e-4, rtol=1e-5)
                # and within int16 rounding of the float product (measured: under 1e-4 of the largest output)
                exact = x.double() @ dequantize_q4(w).double().T + b.double()
                assert (y.double() - exact).abs().max() < 1e-3 * exact.abs().max()
                # each row alone gives the same bits as in any batch (the batch-invariance invariant)
                alone = torch.cat([ops.linear(x[i : i + 1], linear_spec(q4), n) for i in range(m)])
                assert torch.equal(alone, y)
                y8 = ops.q8_linear(x, q8.qs, q8.scale, n)
                torch.testing.assert_close(y8.double(), q8_reference(x, w), atol=2e-4, rtol=1e-5)
                exact8 = x.double() @ dequantize_q8(w).double().T
                assert (y8.double() - exact8).abs().max() < 1e-3 * exact8.abs().max()
                assert torch.equal(torch.cat([ops.q8_linear(x[i : i + 1], q8.qs, q8.scale, n) for i in range(m)]), y8)


@pytest.mark.parametrize("isa", ISAS)
def test_every_layout_gives_a_row_the_same_bits_in_batches_of_any_size(isa: str) -> None:
    """The micro-kernels are instantiated per row count (up to 8 rows a tile): a row's output must not depend on
    which one runs it. Every layer layout and the Q8 matrix, both precisions, batches of 2 to 18 rows."""
    gen = torch.Generator().manual_seed(6)
    n, k = 100, 512
    w = torch.randn(n, k, generator=gen) * 0.05
    q8 = pack_q8(w)
    with on_isa(isa):
        for kind in ("q4", "q4f", "q8l", "q4k", "q5", "q5k", "q6", "q8"):
            spec = None if kind == "q8" else linear_spec(packed_layer(kind, w))
            for is_int8 in (False, True):

                def run(x: torch.Tensor) -> torch.Tensor:
                    if spec is None:
                        return ops.q8_linear(x, q8.qs, q8.scale, n, is_int8=is_int8)
                    return ops.linear(x, spec, n, is_int8=is_int8)

                for m in range(2, 19):
                    x = torch.randn(m, k, generator=gen)
                    alone = torch.cat([run(x[i : i + 1]) for i in range(m)])
                    assert torch.equal(run(x), alone), f"{kind}, int8 {is_int8}, {m} rows"


@pytest.mark.parametrize("isa", ISAS)
def test_int8_activation_kernel_matches_its_reference_and_rows_are_independent(isa: str) -> None:
    """precision "int8": activations in int8 steps of max|x| / 127 per group of 32, exact integer sums (vpdpbusd
    on AVX-512, pmaddubsw on AVX2, the int16 kernel on the same values on the baseline)."""
    with on_isa(isa):
        gen = torch.Generator().manual_seed(3)
        for n, k in [(64, 32), (100, 64), (576, 576), (200, 1536)]:
            w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
            q4 = pack_q4(w, b)
            for m in (1, 7, 8, 9, 33):
                x = torch.randn(m, k, generator=gen)
                x[0, 5] = 0.0  # zeros, and a group with one outlier
                x[-1, :32] *= 1e-3
                x[-1, 7] = 40.0
                y = ops.linear(x, linear_spec(q4), n, is_int8=True)
                reference = q4_reference(x, w, INT8_STEPS) + b.double()
                torch.testing.assert_close(y.double(), reference, atol=2e-4, rtol=1e-5)
                alone = [ops.linear(x[i : i + 1], linear_spec(q4), n, is_int8=True) for i in range(m)]
                assert torch.equal(torch.cat(alone), y)


@pytest.mark.parametrize("isa", ISAS)
def test_q4_k_weights_run_on_their_own_grid_in_both_precisions(isa: str) -> None:
    """A Q4_K tensor's grid (scales d * sc_j and minimums dmin * m_j, which float16 cannot hold) is packed with
    float32 scales: the kernel multiplies the file's own weights, in both precisions, rows independent."""
    rng = np.random.default_rng(4)
    gen = torch.Generator().manual_seed(4)
    with on_isa(isa):
        for n, k in [(48, 256), (208, 768)]:
            grid = grid_of(StoredTensor((n, k), "Q4_K", lambda: random_blocks(rng, "Q4_K", n, k)))
            q, scale, minv = (torch.from_numpy(a) for a in (grid.q, grid.scale, grid.minv))
            assert not can_pack_q4_exactly(scale, minv)  # a real test of the float32 layout
            packed = pack_q4_grid(q, scale, minv, None)
            assert packed.scale.dtype == torch.float32
            w = torch.from_numpy(grid.dequantize()).double()
            for m in (1, 5, 8, 33):
                x = torch.randn(m, k, generator=gen)
                for qmax, is_int8 in ((INT16_STEPS, False), (INT8_STEPS, True)):
                    y = ops.linear(x, linear_spec(packed), n, is_int8=is_int8)
                    torch.testing.assert_close(y.double(), q4_grid_reference(x, q, scale, minv, qmax), atol=2e-4, rtol=1e-5)
                    alone = [ops.linear(x[i : i + 1], linear_spec(packed), n,
                                           is_int8=is_int8) for i in range(m)]  # fmt: skip
                    assert torch.equal(torch.cat(alone), y)
                exact = x.double() @ w.T  # the file's weights, within int16 rounding of the activations
                y = ops.linear(x, linear_spec(packed), n)
                assert (y.double() - exact).abs().max() < 1e-3 * exact.abs().max()


def assert_runs_on_its_grid(x: torch.Tensor, packed, w: torch.Tensor, bias: torch.Tensor, kernel_reference) -> None:
    """In both precisions the float64 reference of the kernel's own arithmetic (kernel_reference(qmax)) plus the
    bias, each row alone the batch's bits; and int16 activations within their rounding of the file's weights w."""
    n = packed.n
    for qmax, is_int8 in ((INT16_STEPS, False), (INT8_STEPS, True)):
        y = ops.linear(x, linear_spec(packed), n, is_int8=is_int8)
        torch.testing.assert_close(y.double(), kernel_reference(qmax) + bias.double(), atol=2e-4, rtol=1e-5)
        alone = [ops.linear(x[i : i + 1], linear_spec(packed), n, is_int8=is_int8) for i in range(x.shape[0])]
        assert torch.equal(torch.cat(alone), y)
    exact = x.double() @ w.T + bias.double()
    y = ops.linear(x, linear_spec(packed), n)
    assert (y.double() - exact).abs().max() < 1e-3 * exact.abs().max()


@pytest.mark.parametrize("isa", ISAS)
def test_q5_layout_runs_q5_grids_on_their_own_values_in_both_precisions(isa: str) -> None:
    """Q5_0, Q5_1, Q5_K in the Q5 layout (the Q4 layout's nibbles plus a word of fifth bits per 32, as few bytes as
    the file's): the kernel multiplies the file's own weights, rows independent, at the largest sums a group can
    make (q = 31 against activations all at the int8 maximum: pmaddubsw's int16 sums overflow without their
    halfway widening)."""
    rng = np.random.default_rng(9)
    gen = torch.Generator().manual_seed(9)
    with on_isa(isa):
        for type_name in ("Q5_0", "Q5_1", "Q5_K"):
            n, k = 48, 512
            grid = random_grid(rng, type_name, n, k)
            q = torch.from_numpy(grid.q).clone()
            q[:16] = 31  # a whole tile at the top of the grid
            scale, minv = torch.from_numpy(grid.scale), torch.from_numpy(grid.minv)
            bias = torch.randn(n, generator=gen)
            packed = pack_q4_grid(q, scale, minv, bias, grid.factors, has_fifth_bits=True)
            assert packed.has_fifth_bits
            q8l = pack_q8_layer_grid(q, scale, minv, bias)
            assert num_weight_bytes(packed) < 0.7 * num_weight_bytes(q8l)
            w = (q.view(n, -1, 32).double() * scale[..., None].double() + minv[..., None].double()).view(n, k)
            for m in (1, 2, 5, 8, 9, 33):
                x = torch.randn(m, k, generator=gen)
                x[0] = 1.0  # every activation at its group's maximum: xq = 127 (int8) or 32767 (int16)
                assert_runs_on_its_grid(x, packed, w, bias, lambda qmax: q4_grid_reference(x, q, scale, minv, qmax))


@pytest.mark.parametrize("isa", ISAS)
def test_q8_layer_layout_runs_every_grid_type_on_its_own_values(isa: str) -> None:
    """Q5_0, Q5_1, Q5_K, Q6_K (scales per 16), Q8_0, and a 4-bit grid: packed as the file holds them, the kernel
    multiplies the file's own weights in both precisions, with and without a bias, rows independent."""
    rng = np.random.default_rng(5)
    gen = torch.Generator().manual_seed(5)
    with on_isa(isa):
        for type_name in ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q4_K"):
            n, k = 48, 512
            grid = grid_of(StoredTensor((n, k), type_name, lambda: random_blocks(rng, type_name, n, k)))
            q = torch.from_numpy(grid.q)
            scale, minv = torch.from_numpy(grid.scale), None if grid.minv is None else torch.from_numpy(grid.minv)
            bias = torch.randn(n, generator=gen)
            packed = pack_q8_layer_grid(q, scale, minv, bias)
            scale16 = scale.repeat_interleave(grid.group // 16, dim=1)
            w = torch.from_numpy(grid.dequantize()).double()
            for m in (1, 5, 8, 33):
                x = torch.randn(m, k, generator=gen)
                assert_runs_on_its_grid(x, packed, w, bias, lambda qmax: q8_layer_reference(x, q, scale16, minv, qmax))


def random_grid(rng: np.random.Generator, type_name: str, n: int, k: int):
    return grid_of(StoredTensor((n, k), type_name, lambda: random_blocks(rng, type_name, n, k)))


def num_weight_bytes(packed) -> int:
    return sum(t.numel() * t.element_size() for t in packed.tensors() if t is not packed.bias)


def both_precisions(x: torch.Tensor, spec, n: int) -> list[torch.Tensor]:
    return [ops.linear(x, spec, n, is_int8=is_int8) for is_int8 in (False, True)]


@pytest.mark.parametrize("isa", ISAS)
def test_file_sized_layouts_give_the_bits_of_the_float32_scaled_ones(isa: str) -> None:
    """Q4_K with its 6-bit scales times a float32 per super-block (4.75 bits a weight, against 6 with float32
    scales) and Q6_K in the Q6 layout (6.6 bits, against 10 in the Q8 layer layout) multiply the same float32
    scales and sum the same integers: the same bits in both precisions, rows independent, with a bias. Except Q6_K
    with int8 activations, whose scales the Q6 layout applies in integers per 32 (q6.inc): the float64 reference."""
    rng = np.random.default_rng(6)
    gen = torch.Generator().manual_seed(6)
    with on_isa(isa):
        for n, k in [(48, 256), (200, 768)]:
            bias = torch.randn(n, generator=gen)
            g4 = random_grid(rng, "Q4_K", n, k)
            q, scale, minv = (torch.from_numpy(a) for a in (g4.q, g4.scale, g4.minv))
            small, wide = pack_q4_grid(q, scale, minv, bias, g4.factors), pack_q4_grid(q, scale, minv, bias)
            assert small.scale.dtype == torch.uint8 and wide.scale.dtype == torch.float32
            g6 = random_grid(rng, "Q6_K", n, k)
            q6 = pack_q6_grid(torch.from_numpy(g6.q), g6.factors, bias)
            q8l = pack_q8_layer_grid(torch.from_numpy(g6.q), torch.from_numpy(g6.scale), None, bias)
            assert num_weight_bytes(q6) < 0.7 * num_weight_bytes(q8l)
            assert num_weight_bytes(small) < 0.8 * num_weight_bytes(wide)
            for m in (1, 5, 8, 9, 33):
                x = torch.randn(m, k, generator=gen)
                x[-1, 3] = 30.0  # an outlier in a group
                for packed, reference in ((small, wide), (q6, q8l)):
                    ys = both_precisions(x, linear_spec(packed), n)
                    expected = both_precisions(x, linear_spec(reference), n)
                    if packed is q6:
                        q, scale16 = torch.from_numpy(g6.q), torch.from_numpy(g6.scale)
                        q6_i8 = q8_layer_reference(x, q, scale16, None, INT8_STEPS)
                        torch.testing.assert_close(ys[1].double(), q6_i8 + bias.double(), atol=2e-4, rtol=1e-5)
                        expected[1] = ys[1]
                    for y, e in zip(ys, expected):
                        assert torch.equal(y, e), (packed.layout, n, k, m)
                    for i in range(m):
                        alone = both_precisions(x[i : i + 1], linear_spec(packed), n)
                        assert all(torch.equal(a[0], y[i]) for a, y in zip(alone, ys))


@pytest.mark.parametrize("isa", ISAS)
def test_a_linear_of_parts_in_several_layouts_is_their_outputs_side_by_side(isa: str) -> None:
    """A q/k/v whose v is Q6_K: q and k run in the Q4 layout, v in the Q6 one, each writing its columns."""
    rng = np.random.default_rng(7)
    gen = torch.Generator().manual_seed(7)
    k = 512
    parts = []
    for type_name, n in (("Q4_K", 64), ("Q6_K", 32), ("Q5_0", 16)):
        g = random_grid(rng, type_name, n, k)
        q = torch.from_numpy(g.q)
        if type_name == "Q4_K":
            parts.append(pack_q4_grid(q, torch.from_numpy(g.scale), torch.from_numpy(g.minv), None, g.factors))
        elif type_name == "Q6_K":
            parts.append(pack_q6_grid(q, g.factors, None))
        else:
            parts.append(pack_q8_layer_grid(q, torch.from_numpy(g.scale), torch.from_numpy(g.minv), None))
    with on_isa(isa):
        x = torch.randn(5, k, generator=gen)
        for fused, side_by_side in zip(
            both_precisions(x, linear_spec(*parts), 112),
            zip(*(both_precisions(x, linear_spec(p), p.n) for p in parts)),
        ):
            assert torch.equal(fused, torch.cat(side_by_side, dim=1))
        with pytest.raises(RuntimeError, match="parts make 112 outputs"):
            ops.linear(x, linear_spec(*parts), 100)


def test_q6_and_super_block_layouts_give_the_same_bits_on_every_simd_variant() -> None:
    isas = [isa for isa in SIMD_ISAS if isa in available_isas()]
    if len(isas) < 2:
        pytest.skip("this CPU runs only one of avx512, avxvnni and avx2")
    rng = np.random.default_rng(8)
    g4, g6 = random_grid(rng, "Q4_K", 64, 512), random_grid(rng, "Q6_K", 64, 512)
    q = torch.from_numpy(g4.q)
    q4 = pack_q4_grid(q, torch.from_numpy(g4.scale), torch.from_numpy(g4.minv), None, g4.factors)
    q6 = pack_q6_grid(torch.from_numpy(g6.q), g6.factors, None)
    q5s = []
    for type_name in ("Q5_0", "Q5_K"):
        g5 = random_grid(rng, type_name, 64, 512)
        scale, minv = torch.from_numpy(g5.scale), torch.from_numpy(g5.minv)
        q5s.append(pack_q4_grid(torch.from_numpy(g5.q), scale, minv, None, g5.factors, has_fifth_bits=True))
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(8))
    results = []
    for isa in isas:
        with on_isa(isa):
            # 1 and 2 rows: one pass over a tile's whole lines on 8 lanes; 13: its 8-row halves, then 5
            results.append([y for p in (q4, q6, *q5s) for m in (1, 2, 13) for y in both_precisions(x[:m], linear_spec(p), 64)])
    assert all(torch.equal(a, b) for other in results[1:] for a, b in zip(results[0], other))


def test_q8_layer_kernels_give_the_same_bits_on_every_simd_variant() -> None:
    """16 lanes and 8, int16 (vpdpwssd, pmaddwd) and int8 activations (AVX-512 multiplies their bytes by the weights'
    plus 128 with vpdpbusd, each sum started from -128 times theirs): the same integer sums and the same float
    operations per lane (baseline x86-64 has no FMA). Scales per 32 (Q5_0; Q5_1 with minimums and a bias; Q8_0 down
    to -128) and per 16 (Q6_K); 1, 4 and 13 rows."""
    isas = [isa for isa in SIMD_ISAS if isa in available_isas()]
    if len(isas) < 2:
        pytest.skip("this CPU runs only one of avx512, avxvnni and avx2")
    rng = np.random.default_rng(6)
    gen = torch.Generator().manual_seed(6)
    specs = []
    for type_name in ("Q5_0", "Q5_1", "Q8_0", "Q6_K"):
        grid = random_grid(rng, type_name, 64, 256)
        q = torch.from_numpy(grid.q)
        if type_name == "Q8_0":
            q[5, :32] = -128
        minv = None if grid.minv is None else torch.from_numpy(grid.minv)
        bias = torch.randn(64, generator=gen) if type_name == "Q5_1" else None
        specs.append(linear_spec(pack_q8_layer_grid(q, torch.from_numpy(grid.scale), minv, bias)))
    x = torch.randn(13, 256, generator=gen)
    outputs = []
    for isa in isas:
        with on_isa(isa):
            outputs.append([y for spec in specs for m in (1, 4, 13) for y in both_precisions(x[:m], spec, 64)])
    assert all(torch.equal(a, b) for other in outputs[1:] for a, b in zip(outputs[0], other))


def test_q4_and_q8_kernels_give_the_same_bits_on_every_simd_variant_in_both_precisions() -> None:
    """The VNNI kernels (16 lanes, and 8 with AVX-VNNI: vpdpbusd, vpdpwssd) and the pmaddubsw / pmaddwd ones make the
    same integer sums and the same float operations after them."""
    isas = [isa for isa in SIMD_ISAS if isa in available_isas()]
    if len(isas) < 2:
        pytest.skip("this CPU runs only one of avx512, avxvnni and avx2")
    gen = torch.Generator().manual_seed(4)
    w, x = torch.randn(200, 1536, generator=gen), torch.randn(33, 1536, generator=gen)
    q4, q8 = pack_q4(w, None), pack_q8(w * 0.05)
    try:
        outs = []
        for isa in isas:
            ops.set_isa(isa)
            # 1 and 2 rows: a tile's whole lines in one pass on 8 lanes; 33: its 8-row halves, then 1
            outs.append([y for m in (1, 2, 33) for y in both_precisions(x[:m], linear_spec(q4), 200)])
            outs[-1] += [ops.q8_linear(x[:m], q8.qs, q8.scale, 200, is_int8=False) for m in (1, 2, 33)]
    finally:
        ops.set_isa("best")
    assert all(torch.equal(a, b) for other in outs[1:] for a, b in zip(outs[0], other))


def test_int8_lm_head_gives_the_same_bits_on_every_variant_and_rows_alone() -> None:
    """The lm_head in precision "int8": AVX-512 multiplies the activations' bytes by the weights' plus 128 with
    vpdpbusd, each sum started from -128 times the activations' (4+ rows), AVX2 and baseline run the int16 kernel on
    the same int8 values: the same integers, so the same bits (baseline x86-64, without FMA, rounds its float steps
    apart); each row's the same alone as among 11 (8 + 1 + 1 + 1 in the AVX-512 tiles)."""
    gen = torch.Generator().manual_seed(8)
    n, k = 1000, 640  # n not a multiple of 16
    w = torch.randn(n, k, generator=gen) * 0.05
    w[3, :32] = -0.05 * 128 / 127  # a group whose weights reach -128
    q8 = pack_q8(w)
    x = torch.randn(11, k, generator=gen)
    x[2, 32:64] = 0.0  # a group of zeros (scale 0)
    outputs = {}
    for isa in available_isas():
        ops.set_isa(isa)
        try:
            y = ops.q8_linear(x, q8.qs, q8.scale, n, is_int8=True)
            alone = [ops.q8_linear(x[i : i + 1], q8.qs, q8.scale, n, is_int8=True) for i in range(11)]
            assert torch.equal(torch.cat(alone), y)
            outputs[isa] = y
        finally:
            ops.set_isa("best")
    simd = [outputs[isa] for isa in SIMD_ISAS if isa in outputs]
    assert all(torch.equal(simd[0], y) for y in simd[1:])
    # against float64 on the int8 steps: x rounded per group of 32 to amax / 127 steps, the weights dequantised
    groups = x.view(11, -1, 32)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    steps = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    x8 = (torch.round(groups * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))) * steps).view(11, k)
    w_grid = dequantize_q8(w)
    reference = x8.double() @ w_grid.double().T
    for y in outputs.values():
        assert (y.double() - reference).abs().max() < 1e-4 * reference.abs().max()
    int16 = ops.q8_linear(x, q8.qs, q8.scale, n)
    assert (int16.double() - reference).abs().max() > 1e-3 * reference.abs().max()  # int8 steps really ran


def test_precision_is_checked_and_int8_greedy_output_is_batch_invariant(grid_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="precision"):
        EngineConfig(precision="int4")
    rng = random.Random(5)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (3, 17, 40, 9, 33)]

    def make(**overrides) -> LLM:
        return LLM(str(grid_llama_dir), block_size=4, num_kv_blocks=256, max_num_seqs=8, precision="int8", **overrides)

    assert make().engine.runner.backend.name == "native"
    alone, *others = greedy_runs(make, prompts)
    for other in others:
        assert other == alone


@pytest.mark.parametrize("max_model_len, k", [(17, 16), (2, 8)])
def test_auto_speculation_starts_on_a_short_context(grid_llama_dir: Path, max_model_len: int, k: int) -> None:
    """The load-time probe of "auto" speculation feeds 1 + k rows near position 48: past a shorter max_model_len the
    native step has no position for them ("position out of range" at load)."""
    def make(speculative: str) -> LLM:
        return LLM(str(grid_llama_dir), block_size=4, num_kv_blocks=64, max_model_len=max_model_len,
                   speculative=speculative, speculative_k=k)  # fmt: skip

    auto = make("auto")
    assert auto.engine.runner.backend.name == "native"
    params = SamplingParams(max_tokens=max_model_len - 1, temperature=0, ignore_eos=True)
    assert auto.generate([[7]], params, use_tqdm=False)[0].token_ids == make("off").generate(
        [[7]], params, use_tqdm=False)[0].token_ids  # fmt: skip


def test_quantisers_reproduce_a_grid_exactly() -> None:
    w = torch.randn(48, 96)
    on_q4, on_q8 = dequantize_q4(w), dequantize_q8(w)
    assert torch.equal(dequantize_q4(on_q4), on_q4)
    torch.testing.assert_close(dequantize_q8(on_q8), on_q8, atol=0, rtol=2e-7)


@pytest.mark.parametrize("cache_dtype, tolerance", [(torch.float32, 1e-3), (torch.bfloat16, 2e-2)])
def test_native_step_matches_transformers_through_chunks_prefix_hits_and_decodes(
    grid_llama_dir: Path, cache_dtype: torch.dtype, tolerance: float
) -> None:
    assert_native_parity(grid_llama_dir, cache_dtype, tolerance)  # measured: 3e-4 (float32 cache), 9e-3 (bf16)


@pytest.mark.parametrize("cache_dtype, tolerance", [(torch.float32, 1e-3), (torch.bfloat16, 2e-2)])
def test_native_step_runs_qwen3_and_gemma3_like_transformers(
    grid_variant_dir: Path, cache_dtype: torch.dtype, tolerance: float
) -> None:
    """Qwen 3's q/k norms; Gemma 3's sandwich norms, GeGLU, scales, sliding layers (window 8: every sequence here
    outgrows it) and global ones with their own rope: the same scenario as the Llama's, against transformers."""
    assert_native_parity(grid_variant_dir, cache_dtype, tolerance)


def assert_native_parity(model_dir: Path, cache_dtype: torch.dtype, tolerance: float) -> None:
    """Chunked prefills with a prefix hit, then decodes, on shuffled blocks: every logits row of the native step
    within tolerance (of the largest logit) of transformers' float32 forward over the same prefix."""
    config = EngineConfig(model=str(model_dir), block_size=BLOCK_SIZE, num_kv_blocks=96, precision="exact")
    sampler = RecordingSampler()
    runner = ModelRunner(load_model(config), config, sampler=sampler)
    assert runner.backend.name == "native"
    if cache_dtype != runner.dtype:  # the kernels read either; the engine allocates its dtype's (bfloat16)
        runner.k_caches = [k.to(cache_dtype) for k in runner.k_caches]
        runner.v_caches = [v.to(cache_dtype) for v in runner.v_caches]
        runner.backend.bind_kv_caches(runner.k_caches, runner.v_caches)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    run = ParityRun(runner, sampler)
    a, b, c, d = run.prefill_in_chunks_with_a_prefix_hit()
    for _ in range(6):
        run.step([(s, 1) for s in (a, b, c, d)])
    for _ in range(3):
        run.step([(s, 1) for s in (d, a)])
    for recorded, expected in run.recorded_and_expected(reference):
        assert (recorded - expected).abs().max() < tolerance * expected.abs().max()


@pytest.mark.parametrize("native", [True, False])
def test_sliding_layers_never_read_keys_before_their_window(tmp_path: Path, native: bool, monkeypatch) -> None:
    """A Gemma 3 of sliding layers only: after a prompt, every cache block wholly before the next token's window is
    filled with NaN (a read of any of it would poison the output); the decode gives the same logits as without."""
    if not native:
        monkeypatch.setenv("SLUICE_NATIVE", "0")
        native_ops.cache_clear()
    try:
        model_dir = on_native_grids(save_tiny_gemma3(tmp_path, layer_types=["sliding_attention"] * 2, num_hidden_layers=2))
        precision = {} if native else {"dtype": "float32", "quantize": "none"}
        config = EngineConfig(model=str(model_dir), block_size=BLOCK_SIZE, num_kv_blocks=32, **precision)
        runs = []
        for poison in (False, True):
            sampler = RecordingSampler()
            runner = ModelRunner(load_model(config), config, sampler=sampler)
            assert (runner.backend.name == "native") == native
            run = ParityRun(runner, sampler)
            seq = run.new_seq(0, run.random_tokens(29))
            run.step([(seq, 99)])
            first_in_window = seq.num_computed - GEMMA3_WINDOW + 1  # the decode sits at position num_computed
            for block in seq.blocks[: first_in_window // BLOCK_SIZE]:
                if poison:
                    for k, v in zip(runner.k_caches, runner.v_caches):
                        blocks_of(runner.backend, k, block).fill_(float("nan"))
                        blocks_of(runner.backend, v, block).fill_(float("nan"))
            run.step([(seq, 1)])
            run.step([(seq, 1)])
            runs.append(sampler.rows)
        assert first_in_window // BLOCK_SIZE >= 4
        for clean, poisoned in zip(*runs):
            assert torch.equal(clean, poisoned)
    finally:
        monkeypatch.delenv("SLUICE_NATIVE", raising=False)
        native_ops.cache_clear()


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def greedy_runs(make, prompts: list[list[int]]) -> list[list[list[int]]]:
    """The same greedy requests alone, all in one batch, again (prefix-cache hits), and with chunked prefill."""
    llm = make()
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    together = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    hits_before = llm.engine.prefix_cache_hit_rate
    cached = [o.token_ids for o in llm.generate(prompts[::-1], GREEDY, use_tqdm=False)][::-1]
    assert llm.engine.prefix_cache_hit_rate > hits_before
    chunked_llm = make(max_num_batched_tokens=16)
    chunked = [o.token_ids for o in chunked_llm.generate(prompts, GREEDY, use_tqdm=False)]
    return [alone, together, cached, chunked]


def test_greedy_output_is_the_same_alone_batched_cached_and_chunked_tiny(grid_llama_dir: Path) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (3, 17, 40, 9, 33)]

    def make(**overrides) -> LLM:
        settings = dict(block_size=4, num_kv_blocks=256, max_num_seqs=8, **overrides)
        return LLM(str(grid_llama_dir), **settings)

    assert make().engine.runner.backend.name == "native"
    alone, *others = greedy_runs(make, prompts)
    for other in others:
        assert other == alone


def test_greedy_output_is_the_same_alone_batched_cached_and_chunked_qwen3_gemma3(grid_variant_dir: Path) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (3, 17, 40, 9, 33)]

    def make(**overrides) -> LLM:
        return LLM(str(grid_variant_dir), block_size=4, num_kv_blocks=256, max_num_seqs=8, **overrides)

    assert make().engine.runner.backend.name == "native"
    alone, *others = greedy_runs(make, prompts)
    for other in others:
        assert other == alone


@pytest.mark.parametrize("precision", ["exact", "int8"])
def test_default_model_greedy_is_batch_invariant_and_exact_matches_transformers(precision: str) -> None:
    """The default config (bfloat16 KV cache, quantize "auto": the native step) in both precisions: alone, batched,
    cached and chunked all give the same tokens; with int16 activations ("exact") they are transformers' float32
    greedy tokens on the same dequantised GGUF weights (int8, the default, rounds as llama.cpp does: its cost is
    measured by bench perplexity, not asserted token for token)."""
    texts = ["The capital of France is", "Write a haiku about the sea.", "日本の首都は", "1, 2, 3, 4,"]

    def make(**overrides) -> LLM:
        return LLM("", block_size=4, num_kv_blocks=1024, max_num_seqs=8, precision=precision, **overrides)

    llm = make()
    assert llm.engine.runner.backend.name == "native"
    prompts = [llm.engine.input_processor.encode_prompt(t) for t in texts]
    runs = greedy_runs(make, prompts)
    for run in runs[1:]:
        assert run == runs[0]
    if precision == "exact":
        refs = [hf_greedy(llm.engine.model_path, p, GREEDY.max_tokens) for p in prompts]
        assert runs[0] == refs


@pytest.mark.parametrize("switch", ["0", "off"])
def test_switched_off_or_missing_extension_falls_back_to_eager(monkeypatch, grid_llama_dir: Path, caplog,
                                                               switch: str) -> None:  # fmt: skip
    monkeypatch.setenv("SLUICE_NATIVE", "bogus")
    native_ops.cache_clear()
    with pytest.raises(ValueError, match="SLUICE_NATIVE='bogus': 0, false, no or off turns the native step off"):
        native_ops()
    monkeypatch.setenv("SLUICE_NATIVE", switch)
    native_ops.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="engine.native"):
            llm = LLM(str(grid_llama_dir), block_size=4, num_kv_blocks=64)
            LLM(str(grid_llama_dir), block_size=4, num_kv_blocks=64)
        assert llm.engine.runner.backend.name == "eager"
        assert sum(f"SLUICE_NATIVE={switch}" in r.getMessage() for r in caplog.records) == 1  # said once
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
        assert len(out.token_ids) == 4
    finally:
        monkeypatch.delenv("SLUICE_NATIVE")
        native_ops.cache_clear()
    assert native_ops() is not None


@pytest.mark.parametrize("chosen", [{"dtype": "float32"}, {"dtype": "float16"}, {"quantize": "none"}])
def test_a_setting_that_leaves_the_native_step_is_warned_of(grid_llama_dir: Path, caplog, chosen: dict) -> None:
    with caplog.at_level(logging.WARNING, logger="engine.loader"):
        llm = LLM(str(grid_llama_dir), block_size=4, num_kv_blocks=64, **chosen)
    assert llm.engine.runner.backend.name == "eager"
    assert "eager PyTorch path (the reference, about 10x slower than the native step" in caplog.text


def test_sluice_isa_forces_a_variant_and_refuses_one_the_cpu_lacks(monkeypatch) -> None:
    runnable = engine_native.available_isas(ops)
    try:
        for name in runnable:
            monkeypatch.setenv("SLUICE_ISA", name)
            native_ops.cache_clear()
            assert native_ops().isa() == ("isa_base" if name == "baseline" else f"isa_{name}")
        monkeypatch.setenv("SLUICE_ISA", "avx1024")
        native_ops.cache_clear()
        with pytest.raises(ValueError, match="SLUICE_ISA='avx1024': the kernel variants are avx512, avxvnni, avx2, baseline"):
            native_ops()
        for lacking in [v for v in engine_native.ISA_VARIANTS if v not in runnable]:  # avx512 on an AVX2 CPU
            monkeypatch.setenv("SLUICE_ISA", lacking)
            native_ops.cache_clear()
            with pytest.raises(ValueError, match=f"this CPU cannot run the {lacking} kernels"):
                native_ops()
    finally:
        monkeypatch.delenv("SLUICE_ISA")
        native_ops.cache_clear()
        ops.set_isa("best")
    assert native_ops().isa() == ops.isa()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_over_scattered_blocks_is_softmax_attention(isa: str, dtype: torch.dtype) -> None:
    if isa not in available_isas():
        pytest.skip(f"this CPU has no {isa}")
    gen = torch.Generator().manual_seed(3)
    kv_heads, heads, dim, block, blocks = 2, 6, 64, 5, 40
    k = torch.randn(blocks, kv_heads, block, dim, generator=gen).to(dtype)  # the step's layout, block-major
    v = torch.randn(blocks, kv_heads, block, dim, generator=gen).to(dtype)
    lengths = torch.tensor([1, 7, 23, 40])
    tables = torch.randperm(blocks, generator=gen)[:32].view(4, 8).to(torch.int32)
    q = torch.randn(4, heads, dim, generator=gen)
    ops.set_isa(isa)
    try:
        out = ops.attention(q, k, v, tables, lengths)
    finally:
        ops.set_isa("best")
    for i, length in enumerate(lengths.tolist()):
        pos = torch.arange(length)
        blocks_of = tables[i].long()[pos // block]
        keys, values = k[blocks_of, :, pos % block].float(), v[blocks_of, :, pos % block].float()  # [L, KVH, D]
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)
        group = heads // kv_heads
        scores = torch.einsum("hd,hld->hl", q[i], keys.repeat_interleave(group, 0)) / dim**0.5
        expected = torch.einsum("hl,hld->hd", scores.softmax(-1), values.repeat_interleave(group, 0))
        torch.testing.assert_close(out[i], expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("isa", ISAS)
def test_a_query_head_gets_the_same_bits_alone_and_beside_its_group(isa: str) -> None:
    """The query heads of a KV head share each key's loads in passes whose size depends on the registers (baseline:
    one head a pass) and on the batch (a step of one or two streams runs one head a task): a head's output must not
    depend on them. Head dims 32, 64 (where AVX2 once gave different bits), 128 and 256 (Gemma 3), groups of 1 to
    7, both caches."""
    gen = torch.Generator().manual_seed(4)
    block, blocks = 5, 48
    lengths = torch.tensor([1, 4, 5, 8, 33, 200, 239])
    tables = torch.randperm(blocks, generator=gen).repeat(len(lengths), 1).to(torch.int32)
    with on_isa(isa):
        for dim in (32, 64, 128, 256):
            q = torch.randn(len(lengths), 7, dim, generator=gen)
            for dtype in (torch.float32, torch.bfloat16):
                k, v = (torch.randn(blocks, 1, block, dim, generator=gen).to(dtype) for _ in range(2))
                alone = [ops.attention(q[:, h : h + 1].contiguous(), k, v, tables, lengths)[:, 0] for h in range(7)]
                for group in range(2, 8):
                    out = ops.attention(q[:, :group].contiguous(), k, v, tables, lengths)
                    for h in range(group):
                        assert torch.equal(out[:, h], alone[h]), f"D {dim}, {dtype}, head {h} of {group}"


def test_bad_step_inputs_are_refused_not_read_out_of_bounds(grid_llama_dir: Path) -> None:
    config = EngineConfig(model=str(grid_llama_dir), block_size=BLOCK_SIZE, num_kv_blocks=8)
    native = ModelRunner(load_model(config), config).backend
    ids, pos = torch.tensor([1, 2]), torch.tensor([0, 1])
    tables = torch.tensor([[0]], dtype=torch.int32)
    rows = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="token id"):
        native.run_tokens(torch.tensor([1, 10**6]), pos, pos, rows, tables)
    with pytest.raises(RuntimeError, match="slot"):
        native.run_tokens(ids, pos, torch.tensor([0, 10**6]), rows, tables)
    with pytest.raises(RuntimeError, match="block table too short"):
        native.run_tokens(ids, torch.tensor([0, 40]), pos, rows, tables)
    with pytest.raises(RuntimeError, match="block id"):
        native.run_tokens(ids, pos, pos, rows, torch.tensor([[99]], dtype=torch.int32))


def test_missing_build_falls_back_with_a_warning(monkeypatch, tmp_path: Path, caplog) -> None:
    import engine.native

    monkeypatch.setattr(engine.native, "BUILD_DIR", tmp_path)
    native_ops.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="engine.native"):
            assert native_ops() is None
        assert "not built" in caplog.text
    finally:
        monkeypatch.undo()
        native_ops.cache_clear()


def test_a_failed_build_warns_and_never_fails_the_install(monkeypatch, tmp_path: Path, capsys) -> None:
    import engine.native.build as build

    monkeypatch.setattr(build, "BUILD_DIR", tmp_path)
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    assert build.main() == 0
    assert "did not build" in capsys.readouterr().err
    assert list(tmp_path.glob("*.so")) == []


def run_step(backend, tables: list[list[int]], block_size: int, parts: list[tuple[int, int, int]]) -> torch.Tensor:
    """One native step over parts (sequence, first position, count): sequence s's token at position p is
    1 + (31 p + 7 s) % 200, its K/V slot where tables[s] puts p; returns the hidden states in part order."""
    ids, pos, slots, rows = [], [], [], []
    for row, (s, start, count) in enumerate(parts):
        for p in range(start, start + count):
            ids.append(1 + (p * 31 + s * 7) % 200)
            pos.append(p)
            slots.append(tables[s][p // block_size] * block_size + p % block_size)
            rows.append(row)
    return backend.run_tokens(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots),
                              torch.tensor(rows, dtype=torch.int32),
                              torch.tensor([tables[s] for s, _, _ in parts], dtype=torch.int32))  # fmt: skip


@pytest.mark.parametrize("isa", ISAS)
def test_a_token_gets_the_same_bits_alone_and_in_any_batch(grid_llama_dir: Path, isa: str) -> None:
    """The attention of a token does not depend on the batch: alone, its query heads are spread over the
    threads one by one; in a batch, the heads of one KV head share the loads. Blocks of 5 tokens, scattered, so
    that runs of four keys cross block boundaries."""
    if isa not in available_isas():
        pytest.skip(f"this CPU has no {isa}")
    block_size, num_seqs = 5, 9
    config = EngineConfig(model=str(grid_llama_dir), block_size=block_size, num_kv_blocks=128)
    native = ModelRunner(load_model(config), config).backend
    order = random.Random(0).sample(range(128), 128)
    lengths = [23 + 5 * s for s in range(num_seqs)]  # the decode token of the last lands at position 63
    tables = [order[s * 14 : (s + 1) * 14] for s in range(num_seqs)]  # 14 blocks: 70 positions each

    def step(seqs: list[int], start: dict[int, int], count: dict[int, int]) -> torch.Tensor:
        return run_step(native, tables, block_size, [(s, start[s], count[s]) for s in seqs])

    ops.set_isa(isa)
    try:
        everyone = list(range(num_seqs))
        step(everyone, {s: 0 for s in everyone}, {s: lengths[s] for s in everyone})  # prefill every prompt
        decode = ({s: lengths[s] for s in everyone}, {s: 1 for s in everyone})
        batched = step(everyone, *decode)
        for s in everyone:
            alone = step([s], *decode)
            assert torch.equal(alone[0], batched[s]), f"sequence {s}"
    finally:
        ops.set_isa("best")


def prefill_bits(backend, chunkings: list[list[int]], length: int, block_size: int) -> list[torch.Tensor]:
    """Hidden states of positions 0 .. length - 1 of one prompt fed in each chunking (sizes of its chunks), each
    chunk in a step beside one decode token of another sequence; blocks scattered over the cache."""
    order = random.Random(1).sample(range(128), 128)
    tables = [order[:64], order[64:]]  # the prompt's, the other sequence's

    def step(parts: list[tuple[int, int, int]]) -> torch.Tensor:
        return run_step(backend, tables, block_size, parts)

    step([(1, 0, 40)])  # the other sequence's prompt
    results = []
    for sizes in chunkings:
        assert sum(sizes) == length
        hidden, start = [], 0
        for n in sizes:
            hidden.append(step([(0, start, n), (1, 40, 1)])[:n])
            start += n
        results.append(torch.cat(hidden))
    return results


@pytest.mark.parametrize("isa", ISAS)
def test_a_prefill_chunk_gives_each_token_the_bits_it_gets_alone(grid_llama_dir: Path, isa: str) -> None:
    """A prompt's token gets the same hidden state, bit for bit, whether the prompt comes whole, in chunks of any
    size (chunked prefill: the sizes depend on the other requests) or one token a step, where it attends as a
    decode does; each chunk beside another sequence's decode. 150 positions in blocks of 5, so that runs of four
    keys cross cache blocks."""
    config = EngineConfig(model=str(grid_llama_dir), block_size=5, num_kv_blocks=128)
    backend = ModelRunner(load_model(config), config).backend
    with on_isa(isa):
        alone, whole, pieces = prefill_bits(backend, [[1] * 150, [150], [37, 50, 63]], 150, 5)
    assert torch.equal(whole, alone)
    assert torch.equal(pieces, alone)


def test_greedy_output_is_the_same_preempted_and_speculated_on_qwen3_and_gemma3(grid_variant_dir: Path) -> None:
    """The same on Qwen 3 and on Gemma 3 past its sliding window (8 keys: every prompt here but one outgrows it), and
    in a pool so small that sequences are preempted and recomputed, and with speculative decoding."""
    rng = random.Random(1)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (3, 17, 40, 9, 33)]

    def make(**overrides) -> LLM:
        return LLM(str(grid_variant_dir), **{"block_size": 4, "num_kv_blocks": 256, "max_num_seqs": 8, **overrides})

    alone, *others = greedy_runs(make, prompts)
    preempting = make(num_kv_blocks=24)
    others.append([o.token_ids for o in preempting.generate(prompts, GREEDY, use_tqdm=False)])
    assert preempting.engine.num_preemptions > 0
    speculating = make(speculative="on")
    others.append([o.token_ids for o in speculating.generate(prompts, GREEDY, use_tqdm=False)])
    for other in others:
        assert other == alone
    for llm in (preempting, speculating):
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (8, 2), (8, 1)])
def test_paired_tokens_of_a_chunk_keep_their_bits_whatever_the_query_group(
    tmp_path: Path, heads: int, kv_heads: int
) -> None:
    """Two consecutive tokens of a prefill chunk score the keys they share in one pass (attend_pair): with 1, 3, 4
    and 8 query heads a KV head, a pair holds 2 to 16 heads, in one pass or several. Each token still gets the bits
    it gets alone, in every chunking, on every variant this CPU runs (41 positions: pairs and a token left over)."""
    path = save_tiny_llama(tmp_path, hidden_size=32 * heads, intermediate_size=256, num_attention_heads=heads,
                           num_key_value_heads=kv_heads)  # fmt: skip
    config = EngineConfig(model=str(on_native_grids(path)), block_size=5, num_kv_blocks=128)
    runner = ModelRunner(load_model(config), config)
    backend = runner.backend
    float32_caches = [[c.float() for c in caches] for caches in (runner.k_caches, runner.v_caches)]
    for caches in (None, float32_caches):  # the pool's bf16 cache, then a float32 one (the kernels take both)
        if caches is not None:
            backend.bind_kv_caches(*caches)
        for isa in available_isas():
            with on_isa(isa):
                alone, whole, pieces = prefill_bits(backend, [[1] * 41, [41], [2, 7, 32]], 41, 5)
            assert torch.equal(whole, alone), isa
            assert torch.equal(pieces, alone), isa


def test_prefill_chunks_keep_their_bits_on_qwen3_and_past_a_sliding_window(grid_variant_dir: Path) -> None:
    """The same with Qwen3's normed queries and keys, and Gemma 3's sliding layers (a window of 8 keys)."""
    config = EngineConfig(model=str(grid_variant_dir), block_size=5, num_kv_blocks=128)
    backend = ModelRunner(load_model(config), config).backend
    alone, whole, pieces = prefill_bits(backend, [[1] * 30, [30], [3, 11, 16]], 30, 5)
    assert torch.equal(whole, alone)
    assert torch.equal(pieces, alone)


@pytest.mark.parametrize("max_model_len", [1, 2, 9, 16])
def test_a_context_shorter_than_the_warm_up_still_starts_and_serves(grid_llama_dir: Path, max_model_len: int) -> None:
    """The native rope table ends at max_model_len: the load's warm-up steps stay below it (they ran 16 positions
    and failed a start with max_model_len 16 or less: "position out of range")."""
    llm = LLM(str(grid_llama_dir), block_size=16, num_kv_blocks=8, max_model_len=max_model_len)
    assert llm.engine.runner.backend.name == "native"
    if max_model_len == 1:
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate([[5]], GREEDY)
        return
    prompt = list(range(5, 5 + max_model_len - 1))
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    assert len(output.token_ids) == 1
