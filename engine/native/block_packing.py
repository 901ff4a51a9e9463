"""The native layouts packed in C++ straight from a GGUF tensor's own blocks (csrc/pack_blocks.inc), onto huge
pages: the bytes packing.py's reference packers give on block_grids.py's grid, in one pass over the file without an
unpacked grid (the numpy / torch path took 6 of a 1B Q4_K_M model's 10.5 s load).

Each function returns None where the packed form would differ from the C++ one's (the caller then packs in Python):
Q4_0 / Q4_1 / Q5_0 / Q5_1 scales that float16 cannot hold (float32 ones then), and a Q4_K / Q5_K tensor whose every
scale and minimum float16 holds (float16 ones then, not the super-block factors). Either is a NaN or a synthetic file, never a
quantiser's output seen so far.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

import numpy as np
import torch

from engine import huge_pages
from engine.checkpoint.stored_tensor import StoredTensor
from engine.native.packing import GROUP, TILE, Q4Packed, Q6Packed, Q8Packed

QK_K = 256  # weights per K-quant super-block
Q5_FROM_BLOCKS = ("Q5_0", "Q5_1", "Q5_K")  # the Q5 layout: the Q4 layout's and a word of fifth bits per 32
Q4_FROM_BLOCKS = ("Q4_0", "Q4_1", "Q4_K", *Q5_FROM_BLOCKS)
Q6_FROM_BLOCKS = ("Q6_K",)
Q8_FROM_BLOCKS = ("Q8_0",)
_EMPTY = torch.empty(0, dtype=torch.float32)


def _tiles(n: int, per_row: int, dtype: torch.dtype) -> torch.Tensor:
    """An output of per_row values for each of n rows padded to whole tiles, on huge pages."""
    return huge_pages.zeros((-(-n // TILE) * TILE * per_row,), dtype)


def _joined_tiles(tensors: Sequence[StoredTensor], per_row: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """One output for the tensors' rows joined along N, each tensor's padded to whole tiles (as packing.py's
    pieces join), on huge pages; then each tensor's part of it, in order."""
    rows = [-(-t.shape[0] // TILE) * TILE for t in tensors]
    joined = huge_pages.zeros((sum(rows) * per_row,), dtype)
    return [joined, *joined.split([r * per_row for r in rows])]


def _blocks(tensor: StoredTensor) -> np.ndarray:
    return np.ascontiguousarray(tensor.blocks())


def _one_type(tensors: Sequence[StoredTensor]) -> tuple[str, int]:
    """The run's type and K; every part but the last a whole number of tiles (the rows of a joined output follow on)."""
    type_name, k = tensors[0].type_name, tensors[0].shape[1]
    if any(t.type_name != type_name or t.shape[1] != k for t in tensors):
        raise ValueError("tensors packed into one run need one type and one K")
    if any(t.shape[0] % TILE for t in tensors[:-1]):
        raise ValueError(f"tensors packed into one run need whole tiles of {TILE} rows but the last")
    return type_name, k


def _packed_joined(tensors: Sequence[StoredTensor], outputs: Sequence[tuple[int, torch.dtype]],
                   pack: Callable[..., bool | None]) -> list[torch.Tensor] | None:
    """The joined outputs (per_row, dtype each), every tensor packed by pack(its blocks, its rows, K, its parts of
    the outputs) straight into its rows; None as soon as pack refuses one (returns False; a packer that never
    refuses returns nothing)."""
    joined = [_joined_tiles(tensors, per_row, dtype) for per_row, dtype in outputs]
    for i, t in enumerate(tensors):
        if pack(_blocks(t), t.shape[0], t.shape[1], *(out[1 + i] for out in joined)) is False:
            return None
    return [out[0] for out in joined]


def q4_from_blocks(ops: ModuleType, *tensors: StoredTensor) -> Q4Packed | None:
    """Q4_0 / Q4_1 / Q4_K tensors of one type in the Q4 layout, or Q5_0 / Q5_1 / Q5_K ones in the Q5 layout, joined
    along N (each packed straight into its rows of the joined outputs), as pack_q4_grid packs their grids, or None
    (see above)."""
    type_name, k = _one_type(tensors)
    n = sum(t.shape[0] for t in tensors)
    has_fifth_bits = type_name in Q5_FROM_BLOCKS
    fifth = [(k // GROUP, torch.int32)] if has_fifth_bits else []

    def with_fifth(pack: Callable[..., bool], num_outputs: int, *flags: bool) -> Callable[..., bool]:
        """pack(blocks, n, k, its outputs, *flags, qh: the last output, or an empty tensor)"""
        def packed(blocks: np.ndarray, rows: int, k: int, *outputs: torch.Tensor) -> bool:
            qh = outputs[num_outputs] if has_fifth_bits else torch.empty(0, dtype=torch.int32)
            return pack(blocks, rows, k, *outputs[:num_outputs], *flags, qh)
        return packed

    if type_name in ("Q4_K", "Q5_K"):
        outputs = [(k // 2, torch.uint8), (k // GROUP, torch.uint8), (k // GROUP, torch.uint8),
                   (k // QK_K, torch.float32), (k // QK_K, torch.float32)]  # fmt: skip
        packed = _packed_joined(tensors, outputs + fifth, with_fifth(ops.pack_q4_k, 5))
        if packed is None:
            return None
        qs, sc, m, d, neg_dmin, *qh = packed
        return Q4Packed(qs, sc, m, _EMPTY, n, d, neg_dmin, *qh)
    has_min = type_name in ("Q4_1", "Q5_1")
    outputs = [(k // 2, torch.uint8), (k // GROUP, torch.float16), (k // GROUP, torch.float16)]
    packed = _packed_joined(tensors, outputs + fifth, with_fifth(ops.pack_q4_legacy, 3, has_min))
    if packed is None:
        return None
    qs, scale, minv, *qh = packed
    return Q4Packed(qs, scale, minv, _EMPTY, n, qh=qh[0] if qh else _EMPTY)


def q6_from_blocks(ops: ModuleType, *tensors: StoredTensor) -> Q6Packed:
    """Q6_K tensors in the Q6 layout, joined along N as q4_from_blocks joins, as pack_q6_grid packs their grids."""
    _, k = _one_type(tensors)
    outputs = [(k // 2, torch.uint8), (k // 16, torch.int32), (k // 16, torch.int8), (k // QK_K, torch.float32)]
    qs, qh, sc, d = _packed_joined(tensors, outputs, ops.pack_q6_k)  # every Q6_K packs
    return Q6Packed(qs, qh, sc, d, _EMPTY, sum(t.shape[0] for t in tensors))


def q8_from_blocks(ops: ModuleType, tensor: StoredTensor) -> Q8Packed:
    """A Q8_0 tensor in the Q8 layout, as pack_q8_grid packs its grid."""
    n, k = tensor.shape
    qs, scale = _tiles(n, k, torch.int8), _tiles(n, k // GROUP, torch.float16)
    ops.pack_q8_0(_blocks(tensor), n, k, qs, scale)
    return Q8Packed(qs, scale, n)
