"""The integer grid of a GGUF tensor, unpacked from its blocks without rounding anything: w = q * scale + minv for
every weight, with q small integers and scale / minv per group of `group` weights along K, in float32.

Every type below is exact in that form (the test checks it bit for bit against the gguf package's dequantize):
  Q4_0  q 0..15,   scale d,        minv -8 d           (group 32)
  Q4_1  q 0..15,   scale d,        minv m              (group 32)
  Q5_0  q 0..31,   scale d,        minv -16 d          (group 32)
  Q5_1  q 0..31,   scale d,        minv m              (group 32)
  Q8_0  q -127..127, scale d,      no minv             (group 32)
  Q4_K  q 0..15,   scale d * sc_j, minv -dmin * m_j    (group 32: the 6-bit scales of a 256-weight super-block)
  Q5_K  q 0..31,   scale d * sc_j, minv -dmin * m_j    (group 32)
  Q6_K  q -32..31, scale d * sc_j, no minv             (group 16: int8 scales)
d, m, dmin are float16 and sc_j, m_j at most 8 bits, so each product is exact in float32, as gguf computes it.
The K-quants also keep those factors (`factors`): the native layouts read the small integers, not the products.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.checkpoint.stored_tensor import StoredTensor

QK_K = 256


@dataclass
class SuperBlockFactors:
    """A K-quant's scale = sc * d and minv = m * neg_dmin: small integers per group, float32 per 256 weights."""

    sc: np.ndarray  # [N, K / group] uint8 (Q4_K, Q5_K) or int8 (Q6_K)
    d: np.ndarray  # [N, K / 256] float32
    m: np.ndarray | None  # [N, K / group] uint8, or None (Q6_K)
    neg_dmin: np.ndarray | None  # [N, K / 256] float32: -dmin


@dataclass
class Grid:
    q: np.ndarray  # [N, K] uint8 (0..2^bits - 1) or int8 (signed types)
    scale: np.ndarray  # [N, K / group] float32
    minv: np.ndarray | None  # [N, K / group] float32, None for the symmetric types
    group: int
    factors: SuperBlockFactors | None = None  # the K-quants'

    def dequantize(self) -> np.ndarray:
        n, k = self.q.shape
        w = self.q.reshape(n, -1, self.group).astype(np.float32) * self.scale[..., None]
        if self.minv is not None:
            w = w + self.minv[..., None]
        return w.reshape(n, k)


def _f16(column: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[B, 16] bytes -> [B, 32]: low nibbles are weights 0..15, high nibbles 16..31 (Q4_0 / Q4_1 / Q5_x)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[B, 4] bytes of a Q5_0 / Q5_1 block -> [B, 32] the fifth bit of each weight."""
    bits = np.ascontiguousarray(qh).view(np.uint32)  # [B, 1]
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of Q4_K / Q5_K scales -> 8 six-bit scales and 8 six-bit minimums per super-block."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mins


def _blocks(tensor: StoredTensor, block_bytes: int) -> tuple[np.ndarray, int, int]:
    n, k = tensor.shape
    return tensor.blocks().reshape(-1, block_bytes), n, k


def _q4_0(t: StoredTensor) -> Grid:
    b, n, k = _blocks(t, 18)
    d = _f16(b[:, 0:2])
    return Grid(_nibbles(b[:, 2:]).reshape(n, k), d.reshape(n, -1), (-8 * d).reshape(n, -1), 32)


def _q4_1(t: StoredTensor) -> Grid:
    b, n, k = _blocks(t, 20)
    return Grid(_nibbles(b[:, 4:]).reshape(n, k), _f16(b[:, 0:2]).reshape(n, -1), _f16(b[:, 2:4]).reshape(n, -1), 32)


def _q5_0(t: StoredTensor) -> Grid:
    b, n, k = _blocks(t, 22)
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4)
    return Grid(q.reshape(n, k), d.reshape(n, -1), (-16 * d).reshape(n, -1), 32)


def _q5_1(t: StoredTensor) -> Grid:
    b, n, k = _blocks(t, 24)
    q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)
    return Grid(q.reshape(n, k), _f16(b[:, 0:2]).reshape(n, -1), _f16(b[:, 2:4]).reshape(n, -1), 32)


def _q8_0(t: StoredTensor) -> Grid:
    b, n, k = _blocks(t, 34)
    return Grid(b[:, 2:].view(np.int8).reshape(n, k), _f16(b[:, 0:2]).reshape(n, -1), None, 32)


def _k_quant(b: np.ndarray, n: int, k: int, q: np.ndarray) -> Grid:
    """Q4_K / Q5_K: d, dmin, 12 bytes of scales, then the weights; q [B, 8, 32] already unpacked."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mins = _k_scales(b[:, 4:16])
    scale = d[:, None] * sc.astype(np.float32)
    minv = -(dmin[:, None] * mins.astype(np.float32))
    factors = SuperBlockFactors(sc.reshape(n, -1), d.reshape(n, -1), mins.reshape(n, -1), (-dmin).reshape(n, -1))
    return Grid(q.reshape(n, k), scale.reshape(n, -1), minv.reshape(n, -1), 32, factors)


def _q4_k(t: StoredTensor) -> Grid:
    b, n, k = _blocks(t, 144)
    qs = b[:, 16:].reshape(-1, 4, 32)  # four runs of 32 bytes: low nibbles are group 2i, high nibbles 2i + 1
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    return _k_quant(b, n, k, q)


def _q5_k(t: StoredTensor) -> Grid:
    b, n, k = _blocks(t, 176)
    qh = b[:, 16:48]  # bit j of byte i: the fifth bit of weight i of group j
    qs = b[:, 48:].reshape(-1, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    return _k_quant(b, n, k, low | (high << 4))


def _q6_k(t: StoredTensor) -> Grid:
    b, n, k = _blocks(t, 210)
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), _f16(b[:, 208:210])
    # two halves of 128 weights; in each, 64 bytes of low nibbles and 32 bytes of 2-bit highs
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    low = low.reshape(-1, 2, 4, 32)
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = ((low | (high << 4)).astype(np.int8) - 32).reshape(n, k)
    scale = d[:, None] * scales.astype(np.float32)
    return Grid(q, scale.reshape(n, -1), None, 16, SuperBlockFactors(scales.reshape(n, -1), d.reshape(n, -1), None, None))


UNPACKERS = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}  # fmt: skip


def grid_of(tensor: StoredTensor) -> Grid:
    """The file's own grid of a quantised 2-D tensor; ValueError for a type without one here."""
    unpack = UNPACKERS.get(tensor.type_name)
    if unpack is None:
        raise ValueError(f"no integer grid for {tensor.type_name} tensors (Sluice reads {', '.join(UNPACKERS)})")
    return unpack(tensor)
