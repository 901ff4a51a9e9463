"""Weights in the native kernels' tile layouts (see csrc/q4_gemm.inc): Q4 (4-bit q, a scale and a minimum per
group of 32) for the layers' linears, Q6 (csrc/q6.inc) for their Q6_K, Q8_0 for the token embedding and lm_head. A
file's Q4_0 / Q4_1 / Q4_K grids are packed as they are (pack_q4_grid); float weights are quantised onto Q4_1 / Q8_0,
and both quantisers
reproduce a GGUF file's grid exactly when the float weights came from one (Q4_1: every group holds its minimum at
q = 0 and its maximum at q = 15; Q8_0: its absolute maximum at |q| = 127).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.checkpoint.block_grids import SuperBlockFactors

GROUP = 32  # weights per scale along K
TILE = 16  # output rows per tile
PACK_ROWS = 1024  # rows packed at a time (a multiple of TILE)


_EMPTY = torch.empty(0, dtype=torch.float32)


@dataclass
class Q4Packed:
    qs: torch.Tensor  # uint8 [N/16 * K/8 * 16 * 4]: per tile, per octet of K, per row a uint32 of 8 nibbles
    # float16 [N/16 * K/32 * 16]; float32 where float16 cannot hold the file's; or (Q4_K) uint8 integers that
    # scale_d / minv_d [N/16 * K/256 * 16] float32 multiply per super-block
    scale: torch.Tensor
    minv: torch.Tensor  # the same dtype and shape
    bias: torch.Tensor  # float32 [N], or empty
    n: int
    scale_d: torch.Tensor = field(default_factory=lambda: _EMPTY)
    minv_d: torch.Tensor = field(default_factory=lambda: _EMPTY)
    # int32 [N/16 * K/32 * 16]: the Q5 layout's fifth bit of each q (see _fifth_words), or empty (the Q4 layout)
    qh: torch.Tensor = field(default_factory=lambda: _EMPTY)
    layout = "q4"

    @property
    def has_fifth_bits(self) -> bool:
        return self.qh.numel() > 0

    def tensors(self) -> list[torch.Tensor]:
        return [self.qs, self.scale, self.minv, self.bias, self.scale_d, self.minv_d, self.qh]


@dataclass
class Q8LayerPacked:
    """A layer's linear in the Q8 layer layout (csrc/q8_gemm.inc, q8l_micro): a grid whose q needs 6 to 8 bits."""

    qs: torch.Tensor  # int8 [N/16 * K/2 * 16 * 2], as Q8Packed's
    scale: torch.Tensor  # float32 [N/16 * K/32 * 16]: one per 32 weights along K, or [N/16 * K/16 * 16] (Q6_K's 16)
    minv: torch.Tensor  # float32 [N/16 * K/32 * 16], or empty (symmetric grids)
    bias: torch.Tensor  # float32 [N], or empty
    n: int
    layout = "q8l"

    @property
    def scale_group(self) -> int:
        """The weights each scale serves along K: 32, or 16 (Q6_K's)."""
        return self.qs.numel() // self.scale.numel()

    def tensors(self) -> list[torch.Tensor]:
        return [self.qs, self.scale, self.minv, self.bias]


@dataclass
class Q6Packed:
    """Q6_K in the Q6 layout (csrc/q6.inc): 6.6 bits a weight, as in the file."""

    qs: torch.Tensor  # uint8 [N/16 * K/8 * 16 * 4]: the low nibbles of q + 32, words as Q4Packed's
    qh: torch.Tensor  # int32 [N/16 * K/16 * 16]: their high 2 bits (see q6.inc)
    sc: torch.Tensor  # int8 [N/16 * K/16 * 16]
    d: torch.Tensor  # float32 [N/16 * K/256 * 16]
    bias: torch.Tensor  # float32 [N], or empty
    n: int
    layout = "q6"

    def tensors(self) -> list[torch.Tensor]:
        return [self.qs, self.qh, self.sc, self.d, self.bias]


LinearSpec = list[tuple[str, int, list[torch.Tensor]]]


def linear_spec(*parts: Q4Packed | Q8LayerPacked | Q6Packed) -> LinearSpec:
    """A linear as the native step takes it: its parts along N, each in its own layout."""
    return [(p.layout, p.n, p.tensors()) for p in parts]


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


def _nibble_words(q: torch.Tensor) -> torch.Tensor:
    """q [Np, K] in 0..15 -> the Q4 layout's words in bytes: per octet of K a little-endian uint32, column 8o + 2i
    at bits 4i, column 8o + 2i + 1 at bits 16 + 4i (i = 0..3), i.e. its bytes are the nibble pairs (0, 2), (4, 6),
    (1, 3), (5, 7); built PACK_ROWS rows at a time."""
    padded, k = q.shape
    octets = torch.empty(padded * k // 2, dtype=torch.uint8)
    for r in range(0, padded, PACK_ROWS):
        rows = q[r : r + PACK_ROWS].to(torch.uint8).view(-1, k // 8, 8)
        pairs = ((0, 2), (4, 6), (1, 3), (5, 7))
        word_bytes = torch.stack([rows[..., lo] | rows[..., hi] << 4 for lo, hi in pairs], -1)
        tiles = word_bytes.view(-1, TILE, k // 8, 4).transpose(1, 2)  # [rows/16, K/8, 16, 4]
        octets[r * k // 2 : (r + rows.shape[0]) * k // 2] = tiles.reshape(-1)
    return octets


# the column of a group of 32 whose fifth bit is bit b of its word: b = 2o + j + 8k + 16e holds 8o + 4k + 2j + e
_FIFTH_BIT_COLUMNS = [8 * ((b & 7) >> 1) + 4 * ((b >> 3) & 1) + 2 * (b & 1) + (b >> 4) for b in range(32)]


def _fifth_words(q: torch.Tensor) -> torch.Tensor:
    """q [Np, K] in 0..31 -> the Q5 layout's fifth bits, int32 [Np/16 * K/32 * 16]: per group of 32 a word per row
    whose bit 2o + j + 8k + 16e is bit 4 of column 8o + 4k + 2j + e (csrc/q4_gemm.inc, FifthBits)."""
    padded, k = q.shape
    fifth = (q.to(torch.uint8).numpy().reshape(padded, k // GROUP, GROUP)[..., _FIFTH_BIT_COLUMNS] >> 4) & 1
    words = np.packbits(fifth, axis=-1, bitorder="little").view("<u4")[..., 0]  # [Np, K/32]
    return _tiles(torch.from_numpy(words.view(np.int32)))


def _factor_tiles(values: np.ndarray, padded: int, dtype: torch.dtype) -> torch.Tensor:
    return _tiles(_pad_rows(torch.from_numpy(np.ascontiguousarray(values)).to(dtype), padded))


def pack_q4_grid(
    q: torch.Tensor,
    scale: torch.Tensor,
    minv: torch.Tensor,
    bias: torch.Tensor | None,
    factors: SuperBlockFactors | None = None,
    has_fifth_bits: bool = False,
) -> Q4Packed:
    """q [N, K] in 0..15 (any integer dtype), or 0..31 with has_fifth_bits (Q5_0, Q5_1, Q5_K: the Q5 layout),
    scale / minv [N, K/32]: kept in float16 when float16 holds every one of them (Q4_0, Q4_1, Q5_0, Q5_1: half the
    bytes to read), else as a K-quant's factors when given (Q4_K, Q5_K: 1.5 bytes a group), else in float32."""
    n, k = q.shape
    padded = -(-n // TILE) * TILE
    b = _EMPTY if bias is None else bias.float().contiguous()
    q = _pad_rows(q, padded)
    assert has_fifth_bits or not bool((q > 15).any()), "q beyond 4 bits needs the Q5 layout"
    qh = _fifth_words(q) if has_fifth_bits else _EMPTY
    octets = _nibble_words(q & 15 if has_fifth_bits else q)
    if factors is not None and not can_pack_q4_exactly(scale, minv):
        assert factors.m is not None and factors.neg_dmin is not None and k % 256 == 0
        return Q4Packed(
            octets, _factor_tiles(factors.sc, padded, torch.uint8), _factor_tiles(factors.m, padded, torch.uint8), b, n,
            _factor_tiles(factors.d, padded, torch.float32), _factor_tiles(factors.neg_dmin, padded, torch.float32), qh,
        )  # fmt: skip
    scale_dtype = torch.float16 if can_pack_q4_exactly(scale, minv) else torch.float32
    scale, minv = _pad_rows(scale.float(), padded), _pad_rows(minv.float(), padded)
    return Q4Packed(octets, _tiles(scale.to(scale_dtype)), _tiles(minv.to(scale_dtype)), b, n, qh=qh)


# The Q6 layout's high-bit bytes: bit pair j of byte b holds the high bits of column QUADS[j][b] of the two octets
Q6_QUADS = ((0, (0, 4, 1, 5)), (0, (2, 6, 3, 7)), (1, (0, 4, 1, 5)), (1, (2, 6, 3, 7)))  # (octet, its columns)


def pack_q6_grid(q: torch.Tensor, factors: SuperBlockFactors, bias: torch.Tensor | None) -> Q6Packed:
    """A Q6_K grid: q [N, K] in -32..31, factors.sc [N, K/16] int8, factors.d [N, K/256]."""
    n, k = q.shape
    padded = -(-n // TILE) * TILE
    u = _pad_rows((q.to(torch.int16) + 32).to(torch.uint8), padded)
    high = (u >> 4).view(padded, k // 16, 2, 8)
    words = torch.zeros(padded, k // 16, 4, dtype=torch.uint8)
    for j, (octet, columns) in enumerate(Q6_QUADS):
        words |= high[:, :, octet, list(columns)] << (2 * j)
    qh = _tiles(words.view(padded, k // 16 * 4).view(torch.int32))
    return Q6Packed(
        _nibble_words(u & 0x0F), qh, _factor_tiles(factors.sc, padded, torch.int8),
        _factor_tiles(factors.d, padded, torch.float32), _EMPTY if bias is None else bias.float().contiguous(), n,
    )  # fmt: skip


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
    """q [N, K] within int8, scale [N, K/32] or [N, K/16], minv [N, K/32] or None; all exact in float32, as the
    file's grid is."""
    n, k = q.shape
    if scale.shape[1] not in (k // GROUP, k // 16):
        raise ValueError(f"a Q8 layer grid's scale is one per 32 or 16 weights, not {tuple(scale.shape)} for K = {k}")
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
