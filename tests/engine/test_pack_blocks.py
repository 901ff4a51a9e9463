"""The C++ packers from a GGUF tensor's blocks (engine/native/block_packing.py) give the bytes of packing.py's
reference packers on block_grids.py's grid: every field, byte for byte (signed zeros and padding lanes included),
on random blocks with edge values (zero, negative, subnormal and extreme scales), rows not a multiple of 16 and
several super-blocks along K."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.synthetic_gguf import random_blocks
from engine.checkpoint.block_grids import grid_of
from engine.checkpoint.stored_tensor import StoredTensor
from engine.native import native_ops
from engine.native.block_packing import q4_from_blocks, q6_from_blocks, q8_from_blocks
from engine.native.packing import pack_q4_grid, pack_q6_grid, pack_q8_grid

ops = native_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the native extension is not built")

BLOCK_BYTES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q6_K": (256, 210), "Q8_0": (32, 34),
               "Q5_0": (32, 22), "Q5_1": (32, 24), "Q5_K": (256, 176)}  # fmt: skip
HALF_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,),
                "Q5_0": (0,), "Q5_1": (0, 2), "Q5_K": (0, 2)}  # fmt: skip  # d (and m / dmin)
MOST_D = {"Q4_0": 8188, "Q5_0": 4094}  # the largest d whose -8 d / -16 d float16 holds
# finite float16 values a file may hold: signed zeros, subnormals, normals of both signs, the extremes
EDGE_HALVES = np.array([0.0, -0.0, 6e-8, -3e-5, 1e-3, -2e-2, 0.5, -1.0, 3.0, 8188.0, -65504.0, 65504.0], np.float16)
SHAPES = [(16, 256), (40, 768), (7, 512), (1024 + 24, 256)]


def edge_blocks(rng: np.random.Generator, type_name: str, n: int, k: int) -> np.ndarray:
    """uint8 [n, k / block * bytes]: random bytes, with the float16 fields drawn from EDGE_HALVES and random small
    values, and the first row's whole blocks zero."""
    block, block_bytes = BLOCK_BYTES[type_name]
    raw = rng.integers(0, 256, size=(n * k // block, block_bytes), dtype=np.uint8)
    for offset in HALF_OFFSETS[type_name]:
        most = MOST_D.get(type_name, np.inf)
        edges = EDGE_HALVES[np.abs(EDGE_HALVES) <= most]
        small = rng.normal(0, 1e-2, size=raw.shape[0]).astype(np.float16)
        values = np.where(rng.random(raw.shape[0]) < 0.3, rng.choice(edges, raw.shape[0]), small)
        raw[:, offset : offset + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw = raw.reshape(n, -1)
    raw[0] = 0
    return raw


def stored(type_name: str, raw: np.ndarray, n: int, k: int) -> StoredTensor:
    return StoredTensor((n, k), type_name, lambda: raw)


def assert_same_bytes(native: object, reference: object) -> None:
    for field in native.__dataclass_fields__:
        a, b = getattr(native, field), getattr(reference, field)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, field
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), field
        else:
            assert a == b, field


def reference_q4(tensor: StoredTensor):
    grid = grid_of(tensor)
    q, scale, minv = (torch.from_numpy(a) for a in (grid.q, grid.scale, grid.minv))
    return pack_q4_grid(q, scale, minv, None, grid.factors, has_fifth_bits=tensor.type_name.startswith("Q5"))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K"])
@pytest.mark.parametrize("make_blocks", [edge_blocks, random_blocks])
def test_q4_from_blocks_is_pack_q4_grid(type_name: str, make_blocks) -> None:
    rng = np.random.default_rng(11)
    for n, k in SHAPES:
        tensor = stored(type_name, make_blocks(rng, type_name, n, k), n, k)
        reference = reference_q4(tensor)
        packed = q4_from_blocks(ops, tensor)
        assert packed is not None, (n, k)
        assert_same_bytes(packed, reference)
        assert reference.scale.dtype == (torch.uint8 if type_name.endswith("_K") else torch.float16)
        assert packed.has_fifth_bits == type_name.startswith("Q5")


def test_q4_forms_the_python_packer_keeps_are_left_to_it() -> None:
    """float16 holds every Q4_K scale and minimum (pack_q4_grid keeps float16 then); a Q4_1 NaN and a Q4_0 d whose
    -8 d float16 cannot hold need float32 (and Q5_1's NaN, Q5_0's -16 d)."""
    rng = np.random.default_rng(12)
    n, k = 32, 512
    raw = random_blocks(rng, "Q4_K", n, k).reshape(-1, 144)
    raw[:, 0:4] = np.array([1.0, 0.5], np.float16).view(np.uint8)  # d * sc and dmin * m: small exact numbers
    tensor = stored("Q4_K", raw.reshape(n, -1), n, k)
    assert reference_q4(tensor).scale.dtype == torch.float16
    assert q4_from_blocks(ops, tensor) is None
    for type_name, offset, value in (("Q4_1", 2, np.nan), ("Q4_0", 0, 9000.0), ("Q5_1", 2, np.nan), ("Q5_0", 0, 5000.0)):
        raw = random_blocks(rng, type_name, n, k)
        raw[5, offset : offset + 2] = np.array([value], np.float16).view(np.uint8)
        tensor = stored(type_name, raw, n, k)
        assert reference_q4(tensor).scale.dtype == torch.float32
        assert q4_from_blocks(ops, tensor) is None


@pytest.mark.parametrize("make_blocks", [edge_blocks, random_blocks])
def test_q6_from_blocks_is_pack_q6_grid(make_blocks) -> None:
    rng = np.random.default_rng(13)
    for n, k in SHAPES:
        tensor = stored("Q6_K", make_blocks(rng, "Q6_K", n, k), n, k)
        grid = grid_of(tensor)
        assert_same_bytes(q6_from_blocks(ops, tensor), pack_q6_grid(torch.from_numpy(grid.q), grid.factors, None))


@pytest.mark.parametrize("make_blocks", [edge_blocks, random_blocks])
def test_q8_from_blocks_is_pack_q8_grid(make_blocks) -> None:
    rng = np.random.default_rng(14)
    for n, k in SHAPES + [(24, 32), (9, 96)]:
        tensor = stored("Q8_0", make_blocks(rng, "Q8_0", n, k), n, k)
        grid = grid_of(tensor)
        reference = pack_q8_grid(torch.from_numpy(grid.q), torch.from_numpy(grid.scale))
        assert_same_bytes(q8_from_blocks(ops, tensor), reference)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_K", "Q6_K"])
def test_tensors_of_one_type_pack_joined_as_their_pieces_join(type_name: str) -> None:
    """A fused q/k or gate/up of one type packs straight into one output: the bytes of each part packed alone,
    joined as packing.py joins pieces (each part's tiles in turn), the last part's rows padded to a whole tile."""
    rng = np.random.default_rng(16)
    k = 512
    parts = [stored(type_name, random_blocks(rng, type_name, n, k), n, k) for n in (48, 16, 7)]
    pack = q6_from_blocks if type_name == "Q6_K" else q4_from_blocks
    alone = [pack(ops, t) for t in parts]
    joined = pack(ops, *parts)
    assert joined.n == 48 + 16 + 7
    for field in joined.__dataclass_fields__:
        if isinstance(getattr(joined, field), torch.Tensor) and getattr(joined, field).numel():
            expected = torch.cat([getattr(p, field) for p in alone])
            assert torch.equal(getattr(joined, field).view(torch.uint8), expected.view(torch.uint8)), field
    with pytest.raises(ValueError, match="one type and one K"):
        pack(ops, parts[0], stored(type_name, random_blocks(rng, type_name, 16, 256), 16, 256))
    with pytest.raises(ValueError, match="whole tiles"):
        pack(ops, parts[2], parts[0])


def test_blocks_of_the_wrong_size_are_refused() -> None:
    rng = np.random.default_rng(15)
    tensor = stored("Q6_K", random_blocks(rng, "Q6_K", 16, 256), 16, 512)
    with pytest.raises(RuntimeError, match="rows of"):
        q6_from_blocks(ops, tensor)


def test_a_matrix_packed_in_python_chunk_by_chunk_is_the_whole_matrix_packed_at_once() -> None:
    """A head re-quantised onto Q8 (a float or K-quant one) is packed PACK_ROWS rows at a time, each chunk's tiles
    written into the whole outputs as it comes: the bytes of pack_q8 on the whole matrix."""
    from engine.native.native_backend import PackPlan, _q8_matrix
    from engine.native.packing import PACK_ROWS, pack_q8

    w = torch.randn(2 * PACK_ROWS + 48, 128, generator=torch.Generator().manual_seed(17))
    packed = _q8_matrix(ops, StoredTensor(tuple(w.shape), "F32", lambda: w.numpy()), PackPlan())
    assert_same_bytes(packed, pack_q8(w))
