"""Weights in the native kernels' tile layouts (see csrc/kernels.inc): Q4 (4-bit q, a scale and a minimum per
group of 32) for the layers' linears, Q8_0 for the token embedding and lm_head. A file's Q4_0 / Q4_1 / Q4_K grids
are packed as they are (pack_q4_grid); float weights are quantised onto Q4_1 / Q8_0, and both quantisers
reproduce a GGUF file's grid exactly when the float weights came from one (Q4_1: every group holds its minimum at
q = 0 and its maximum at q = 15; Q8_0: its absolute maximum at |q| = 127).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # weights per scale along K
TILE = 16  # output rows per tile
PACK_ROWS = 1024  # rows packed at a time (a multiple of TILE)


@dataclass
class Q4Packed:
    qs: torch.Tensor  # uint8 [N/16 * K/8 * 16 * 4]: per tile, per octet of K, per row a uint32 of 8 nibbles
    scale: torch.Tensor  # float16 [N/16 * K/32 * 16], or float32 where float16 cannot hold the file's (Q4_K)
    minv: torch.Tensor  # the same dtype and shape
    bias: torch.Tensor  # float32 [N], or empty
    n: int


@dataclass
class Q8LayerPacked:
    """A layer's linear in the Q8 layer layout (csrc/kernels.inc, q8l_micro): a grid whose q needs 5 to 8 bits, or a
    fused linear with such a part (its 4-bit parts then held in bytes too)."""

    qs: torch.Tensor  # int8 [N/16 * K/2 * 16 * 2], as Q8Packed's
    scale: torch.Tensor  # float32 [N/16 * K/16 * 16]: one per 16 weights along K
    minv: torch.Tensor  # float32 [N/16 * K/32 * 16], or empty (symmetric grids)
    bias: torch.Tensor  # float32 [N], or empty
    n: int


@dataclass
class Q8Packed:
    qs: torch.Tensor  # int8 [N/16 * K/2 * 16 * 2]: per tile, per column pair, per row the pair
    scale: torch.Tensor  # float16 [N/16 * K/32 * 16]
    n: int


_HALF_TINY = 2.0**-24  # the smallest positive float16


def _half(x: torch.Tensor) -> torch.Tensor:
    """Scales and minimums are float16, as a GGUF stores them (Q4_1's d and m, Q8_0's d): rounding to float16
    gives a GGUF's own values back exactly, and the kernels read 2 bytes per group instead of 4."""
    return x.clamp(-65504, 65504).half().float()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """[Np, X] -> [Np/16, X, 16] flattened: row j of a tile becomes lane j."""
    return t.view(-1, TILE, t.shape[1]).transpose(1, 2).contiguous().view(-1)


def q4_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [N, K] -> (q uint8 [N, K] in 0..15, scale [N, K/32], minimum [N, K/32]); w ~ q * scale + minimum.
    The same grid as Linear.quantize_int4."""
    n, k = w.shape
    groups = w.float().view(n, k // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = _half(((hi - lo) / 15).clamp_min(_HALF_TINY))
    lo = _half(lo)
    q = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8).view(n, k)
    return q, scale, lo


def q8_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (q int8 [N, K] in -127..127, scale [N, K/32]); w ~ q * scale."""
    n, k = w.shape
    groups = w.float().view(n, k // GROUP, GROUP)
    scale = _half((groups.abs().amax(-1) / 127).clamp_min(_HALF_TINY))
    q = (groups / scale[..., None]).round().clamp(-127, 127).to(torch.int8).view(n, k)
    return q, scale


def pack_q4(w: torch.Tensor, bias: torch.Tensor | None) -> Q4Packed:
    return pack_q4_grid(*q4_grid(w), bias)


def pack_q8(w: torch.Tensor) -> Q8Packed:
    return pack_q8_grid(*q8_grid(w))


def _fits_half(x: torch.Tensor) -> bool:
    return bool(torch.equal(x.half().float(), x.float()))


def can_pack_q4_exactly(scale: torch.Tensor, minv: torch.Tensor) -> bool:
    """Whether a grid's scales and minimums survive the Q4 layout's float16 unchanged (Q4_0, Q4_1: always)."""
    return _fits_half(scale) and _fits_half(minv)


def pack_q4_grid(q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, bias: torch.Tensor | None) -> Q4Packed:
    """q [N, K] in 0..15 (any integer dtype), scale / minv [N, K/32]: kept in float16 when float16 holds every
    one of them (Q4_0, Q4_1: half the bytes to read), else in float32 (Q4_K's d * sc_j, dmin * m_j)."""
    scale_dtype = torch.float16 if can_pack_q4_exactly(scale, minv) else torch.float32
    n, k = q.shape
    padded = -(-n // TILE) * TILE
    q, scale, minv = _pad_rows(q, padded), _pad_rows(scale.float(), padded), _pad_rows(minv.float(), padded)
    # per octet of K a little-endian uint32: column 8o + 2i at bits 4i, column 8o + 2i + 1 at bits 16 + 4i
    # (i = 0..3), i.e. its bytes are the nibble pairs (0, 2), (4, 6), (1, 3), (5, 7); built in bytes, PACK_ROWS
    # rows at a time
    octets = torch.empty(padded * k // 2, dtype=torch.uint8)
    for r in range(0, padded, PACK_ROWS):
        rows = q[r : r + PACK_ROWS].to(torch.uint8).view(-1, k // 8, 8)
        pairs = ((0, 2), (4, 6), (1, 3), (5, 7))
        word_bytes = torch.stack([rows[..., lo] | rows[..., hi] << 4 for lo, hi in pairs], -1)
        tiles = word_bytes.view(-1, TILE, k // 8, 4).transpose(1, 2)  # [rows/16, K/8, 16, 4]
        octets[r * k // 2 : (r + rows.shape[0]) * k // 2] = tiles.reshape(-1)
    empty = torch.empty(0, dtype=torch.float32)
    return Q4Packed(
        octets,
        _tiles(scale.to(scale_dtype)),
        _tiles(minv.to(scale_dtype)),
        empty if bias is None else bias.float().contiguous(),
        n,
    )


def pack_q8_grid(q: torch.Tensor, scale: torch.Tensor) -> Q8Packed:
    """q [N, K] in -127..127, scale [N, K/32] (rounded to float16)."""
    n, k = q.shape
    padded = -(-n // TILE) * TILE
    q, scale = _pad_rows(q.to(torch.int8), padded), _pad_rows(scale.float(), padded)
    pairs = q.view(-1, TILE, k // 2, 2).transpose(1, 2).contiguous().view(-1)  # [Np/16, K/2, 16, 2]
    return Q8Packed(pairs, _tiles(scale.half()), n)


def pack_q8_layer_grid(
    q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None, bias: torch.Tensor | None
) -> Q8LayerPacked:
    """q [N, K] within int8, scale [N, K/16] or [N, K/32] (a group-32 grid: each scale serves both halves), minv
    [N, K/32] or None; all exact in float32, as the file's grid is."""
    n, k = q.shape
    if scale.shape[1] == k // GROUP:
        scale = scale.repeat_interleave(2, dim=1)
    padded = -(-n // TILE) * TILE
    q8 = _pad_rows(q.to(torch.int8), padded)
    pairs = q8.view(-1, TILE, k // 2, 2).transpose(1, 2).contiguous().view(-1)  # [Np/16, K/2, 16, 2]
    empty = torch.empty(0, dtype=torch.float32)
    return Q8LayerPacked(
        pairs,
        _tiles(_pad_rows(scale.float(), padded)),
        empty if minv is None else _tiles(_pad_rows(minv.float(), padded)),
        empty if bias is None else bias.float().contiguous(),
        n,
    )


INT16_STEPS = 32767.0  # precision "exact": activations in int16 steps of max|x| / 32767 per group
INT8_STEPS = 127.0  # precision "int8": in int8 steps of max|x| / 127 (llama.cpp's Q8_0 activations)


def quantize_activations(x: torch.Tensor, qmax: float = INT16_STEPS) -> torch.Tensor:
    """The activations the Q4 kernel multiplies with: each row's groups of 32 rounded to steps of max|x| / qmax
    (as float [M, K]; their group sums are what the kernel multiplies the minimums with)."""
    m, k = x.shape
    groups = x.float().view(m, k // GROUP, GROUP)
    amax = groups.abs().amax(-1, keepdim=True)
    # a true division, as the kernel's (`127.0 / tensor` multiplies by a reciprocal: ties round differently)
    inv = torch.where(amax > 0, torch.full_like(amax, qmax) / amax, torch.zeros_like(amax))
    return (torch.round(groups * inv) * (amax / qmax)).view(m, k)


def q8_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the Q8 kernel computes for x [M, K] and the float weight w [N, K], in float64."""
    return quantize_activations(x).double() @ dequantize_q8(w).double().T


def q4_reference(x: torch.Tensor, w: torch.Tensor, qmax: float = INT16_STEPS) -> torch.Tensor:
    """What the Q4 kernel computes for x [M, K] and the float weight w [N, K], in float64 (without bias)."""
    return q4_grid_reference(x, *q4_grid(w), qmax)


def q4_grid_reference(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, qmax: float = INT16_STEPS
) -> torch.Tensor:
    """What the Q4 kernel computes for x [M, K] and the grid w = q * scale + minv (q [N, K], scale / minv
    [N, K/32]), in float64 (without bias)."""
    n, k = q.shape
    xq = quantize_activations(x, qmax).double().view(x.shape[0], -1, GROUP)
    xsum = xq.sum(-1)  # [M, G]
    dots = torch.einsum("mgk,ngk->mng", xq, q.double().view(n, -1, GROUP))  # [M, N, G]
    return (dots * scale.double()[None]).sum(-1) + xsum @ minv.double().T


def dequantize_q4(w: torch.Tensor) -> torch.Tensor:
    """The values the native kernels compute with, as a float [N, K] matrix (for tests and references)."""
    q, scale, lo = q4_grid(w)
    n, k = w.shape
    return (q.view(n, -1, GROUP).float() * scale[..., None] + lo[..., None]).view(n, k)


def dequantize_q8(w: torch.Tensor) -> torch.Tensor:
    q, scale = q8_grid(w)
    n, k = w.shape
    return (q.view(n, -1, GROUP).float() * scale[..., None]).view(n, k)


def q8_layer_reference(
    x: torch.Tensor, q: torch.Tensor, scale16: torch.Tensor, minv: torch.Tensor | None, qmax: float = INT16_STEPS
) -> torch.Tensor:
    """What the Q8 layer kernel computes for x [M, K] and w = q * scale16 (+ minv per 32), in float64."""
    n, k = q.shape
    xq = quantize_activations(x, qmax).double().view(x.shape[0], -1, GROUP // 2)
    dots = torch.einsum("mgk,ngk->mng", xq, q.double().view(n, -1, GROUP // 2))  # [M, N, K/16]
    y = (dots * scale16.double()[None]).sum(-1)
    if minv is not None:
        y = y + xq.view(x.shape[0], -1, GROUP).sum(-1) @ minv.double().T
    return y
