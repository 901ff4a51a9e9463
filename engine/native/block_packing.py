"""The native layouts packed in C++ straight from a GGUF tensor's own blocks (csrc/pack_blocks.inc), onto huge
pages: the bytes packing.py's reference packers give on block_grids.py's grid, in one pass over the file without an
unpacked grid (the numpy / torch path took 6 of a 1B Q4_K_M model's 10.5 s load).

Each function returns None where the packed form would differ from the C++ one's (the caller then packs in Python):
Q4_0 / Q4_1 scales that float16 cannot hold (float32 ones then), and a Q4_K tensor whose every scale and minimum
float16 holds (float16 ones then, not the super-block factors). Either is a NaN or a synthetic file, never a
quantiser's output seen so far.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from engine import huge_pages
from engine.checkpoint.stored_tensor import StoredTensor
from engine.native.packing import GROUP, TILE, Q4Packed, Q6Packed, Q8Packed

QK_K = 256  # weights per K-quant super-block
Q4_FROM_BLOCKS = ("Q4_0", "Q4_1", "Q4_K")
Q6_FROM_BLOCKS = ("Q6_K",)
Q8_FROM_BLOCKS = ("Q8_0",)
_EMPTY = torch.empty(0, dtype=torch.float32)


def _tiles(n: int, per_row: int, dtype: torch.dtype) -> torch.Tensor:
    """An output of per_row values for each of n rows padded to whole tiles, on huge pages."""
    return huge_pages.zeros((-(-n // TILE) * TILE * per_row,), dtype)


def _blocks(tensor: StoredTensor) -> np.ndarray:
    return np.ascontiguousarray(tensor.blocks())


def q4_from_blocks(ops: ModuleType, tensor: StoredTensor) -> Q4Packed | None:
    """A Q4_0 / Q4_1 / Q4_K tensor in the Q4 layout, as pack_q4_grid packs its grid, or None (see above)."""
    n, k = tensor.shape
    qs = _tiles(n, k // 2, torch.uint8)
    if tensor.type_name == "Q4_K":
        sc, m = _tiles(n, k // GROUP, torch.uint8), _tiles(n, k // GROUP, torch.uint8)
        d, neg_dmin = _tiles(n, k // QK_K, torch.float32), _tiles(n, k // QK_K, torch.float32)
        if not ops.pack_q4_k(_blocks(tensor), n, k, qs, sc, m, d, neg_dmin):
            return None
        return Q4Packed(qs, sc, m, _EMPTY, n, d, neg_dmin)
    scale, minv = _tiles(n, k // GROUP, torch.float16), _tiles(n, k // GROUP, torch.float16)
    if not ops.pack_q4_legacy(_blocks(tensor), n, k, qs, scale, minv, tensor.type_name == "Q4_1"):
        return None
    return Q4Packed(qs, scale, minv, _EMPTY, n)


def q6_from_blocks(ops: ModuleType, tensor: StoredTensor) -> Q6Packed:
    """A Q6_K tensor in the Q6 layout, as pack_q6_grid packs its grid."""
    n, k = tensor.shape
    qs, qh = _tiles(n, k // 2, torch.uint8), _tiles(n, k // 16, torch.int32)
    sc, d = _tiles(n, k // 16, torch.int8), _tiles(n, k // QK_K, torch.float32)
    ops.pack_q6_k(_blocks(tensor), n, k, qs, qh, sc, d)
    return Q6Packed(qs, qh, sc, d, _EMPTY, n)


def q8_from_blocks(ops: ModuleType, tensor: StoredTensor) -> Q8Packed:
    """A Q8_0 tensor in the Q8 layout, as pack_q8_grid packs its grid."""
    n, k = tensor.shape
    qs, scale = _tiles(n, k, torch.int8), _tiles(n, k // GROUP, torch.float16)
    ops.pack_q8_0(_blocks(tensor), n, k, qs, scale)
    return Q8Packed(qs, scale, n)
