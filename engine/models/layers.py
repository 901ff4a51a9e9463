"""Building blocks shared by the model files: per-step metadata, linears with optional weight-only
quantised copies, norms, rotary embeddings and paged attention.

Every model's forward takes the flattened tokens of one engine step ([T] ids, no batch dimension) plus a
StepContext that the model runner builds once per step and every layer shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.rope import rope_inv_freq

INT4_GROUP_SIZE = 32
PACK_BATCH_HINT = 32  # rows oneDNN lays a packed weight out for; any M works (measured: best across 1..512)


def copy_weight(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """A checkpoint's tensor into a parameter (or a slice of one) of the shape the config gives: copy_ would broadcast
    a smaller tensor silently, or fail with a size error that names nothing."""
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(f"the weights do not match the model's config: {name} is {tuple(tensor.shape)}, the config "
                         f"makes it {tuple(target.shape)}")  # fmt: skip
    target.copy_(tensor)


@dataclass
class PrefillSpan:
    """One multi-token chunk: its tokens are rows [start, end) of the step, at positions start_pos.."""

    start: int
    end: int
    start_pos: int
    kv_slots: torch.Tensor | None  # [start_pos + n] cache slots of all its positions; None: attend in-chunk only
    mask: torch.Tensor | None  # [n, start_pos + n] bool, causal with offset; None with kv_slots None


@dataclass
class StepContext:
    """Tensors describing one step, built once by the runner and read by every layer.

    Token rows are ordered decodes first (one token each, rows [0, num_decode)), then prefill spans.
    """

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: where each token's K/V is written
    num_decode: int
    # decode rows attend over LayerCache.k_stage / v_stage. When decode_gather is set the stage is rebuilt from
    # the paged cache (blocks [B * nblk], each row's blocks padded with block 0); otherwise the same sequences
    # decoded last step and only this step's K/V is appended at (row, position).
    decode_gather: torch.Tensor | None
    decode_mask: torch.Tensor | None  # additive, 0 where the key exists, else -inf: [B, 1, 1, L] if decode_sdpa
    decode_sdpa: bool = False  # else [KVH * B, 1, L] for the hand-written path
    decode_rows: torch.Tensor | None = None  # [B] 0 .. B-1
    prefills: list[PrefillSpan] = field(default_factory=list)
    use_quant: bool = False  # route linears through the weight-only quantised kernels
    rope_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # per rotary module


@dataclass
class LayerCache:
    """One layer's paged KV cache, head-major [KVH, num_blocks, block_size, D] so that gathered blocks come out
    as [KVH, B, L, D], ready for batched matmuls; plus the decode batch's history as contiguous tensors.

    The stage saves re-gathering every sequence's whole history each step (memory traffic dominates batched
    decode here); it is a copy: the paged blocks stay the source of truth.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_stage: torch.Tensor | None = None  # [KVH, B, stage length, D]
    v_stage: torch.Tensor | None = None


class Linear(nn.Module):
    """y = x W^T + b, with an optional weight-only quantised copy used when the step asks for it (small M)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None  # oneDNN's pre-packed copy of weight, see pack()
        self.qbits = 0  # 0: no quantised copy; 4: int4 groups
        self.qweight: torch.Tensor | None = None
        self.qscales: torch.Tensor | None = None

    def quantize_int4(self, dtype: torch.dtype) -> None:
        """Asymmetric min/max 4-bit groups along K; for Q4_1 GGUF weights this reproduces the file's grid."""
        w = self.weight.detach().float()
        n, k = w.shape
        if k % INT4_GROUP_SIZE or n % 16:  # the packing kernel's constraints
            return
        groups = w.view(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-10)
        q = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
        self.qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # the kernel dequantises as (q - 8) * scale + zero
        zero = lo + 8 * scale
        self.qscales = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(dtype)  # [K / group, N, 2]
        self.qbits = 4

    def pack(self) -> None:
        """Keep the bf16 weight in oneDNN's blocked layout too: F.linear re-lays it out on every call
        (measured: 2.7x faster at M=1, 1.3x at M=32, same results)."""
        if self.weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_BATCH_HINT)

    def forward(self, x: torch.Tensor, quant: bool = False) -> torch.Tensor:
        if not quant or not self.qbits:
            if self.packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, INT4_GROUP_SIZE, self.qscales)
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Module):
    """Llama's convention: the weight multiplies the normalised row after its cast back to x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # same rounding as the reference: normalise in float32, cast back, then scale
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def scale(self) -> torch.Tensor:
        """The float32 factor each normalised value is multiplied by (what the native step needs)."""
        return self.weight.detach().float().contiguous()


class UnitOffsetRMSNorm(RMSNorm):
    """Gemma's convention: the checkpoint stores w and the row is scaled by (1 + w), in float32, then cast."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def scale(self) -> torch.Tensor:
        return (1.0 + self.weight.detach().float()).contiguous()


class Rotary(nn.Module):
    """Rotary position embedding in the rotate-half layout of Hugging Face Llama checkpoints."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        inv_freq, scale = rope_inv_freq(hf_config, head_dim, layer_type)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        self.half = head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: one roll instead of slices, a negation and a cat
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1), persistent=False)  # [max_positions, head_dim]
        self.register_buffer("sin", torch.cat([-sin, sin], dim=-1), persistent=False)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """x: [T, heads, head_dim] at ctx.positions."""
        cached = ctx.rope_cache.get(id(self))
        if cached is None:  # once per step, shared by all layers: [T, 1, head_dim]
            cached = (self.cos[ctx.positions][:, None].to(x.dtype), self.sin[ctx.positions][:, None].to(x.dtype))
            ctx.rope_cache[id(self)] = cached
        cos, sin = cached
        return torch.addcmul(x * cos, torch.roll(x, self.half, dims=-1), sin)


def _window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Q, K] bool: key j is visible to query i (causal, and inside the window: q - window < k <= q)."""
    visible = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        visible &= key_pos[None, :] > query_pos[:, None] - window
    return visible


def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """q [..., n, D], k / v [..., L, D], visible bool broadcastable to [..., n, L]: tanh-capped scores, as in
    transformers' eager attention (no fused kernel caps the scores)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    cache: LayerCache,
    ctx: StepContext,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend causally over each sequence's history: [T, H * D].

    With a window, a query at position p sees keys p - window + 1 .. p only, and the keys before the earliest
    window of the step are not read at all (sliced off the stage, left out of a prefill's gather)."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    k_flat = cache.k.view(num_kv_heads, -1, head_dim)
    v_flat = cache.v.view(num_kv_heads, -1, head_dim)
    k_flat.index_copy_(1, ctx.slot_mapping, k.transpose(0, 1))
    v_flat.index_copy_(1, ctx.slot_mapping, v.transpose(0, 1))
    parts = []

    nd = ctx.num_decode
    if nd:
        if ctx.decode_gather is not None:
            cache.k_stage = cache.k.index_select(1, ctx.decode_gather).view(num_kv_heads, nd, -1, head_dim)
            cache.v_stage = cache.v.index_select(1, ctx.decode_gather).view(num_kv_heads, nd, -1, head_dim)
        else:
            decode_positions = ctx.positions[:nd]
            cache.k_stage[:, ctx.decode_rows, decode_positions] = k[:nd].transpose(0, 1)
            cache.v_stage[:, ctx.decode_rows, decode_positions] = v[:nd].transpose(0, 1)
        k_stage, v_stage, mask = cache.k_stage, cache.v_stage, ctx.decode_mask
        if window is not None or softcap is not None:
            positions = ctx.positions[:nd]
            lo = 0 if window is None else max(0, int(positions.min()) - window + 1)
            k_stage, v_stage = k_stage[:, :, lo:], v_stage[:, :, lo:]
            visible = _window_mask(positions, torch.arange(lo, lo + k_stage.shape[2]), window)  # [B, L']
            mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, float("-inf"))
            mask = mask[:, None, None, :] if ctx.decode_sdpa or softcap is not None else mask.repeat(num_kv_heads, 1)[:, None, :]
        if softcap is not None:
            qd = q[:nd].view(nd, num_kv_heads, group, head_dim)
            out = _softcapped_attention(qd, k_stage.transpose(0, 1), v_stage.transpose(0, 1), mask == 0, scale, softcap)
            parts.append(out.reshape(nd, -1))
        elif ctx.decode_sdpa:
            # one or two rows: SDPA's flash kernel, the G query heads of a KV head as G query rows
            qd = q[:nd].view(nd, num_kv_heads, group, head_dim)
            keys, values = k_stage.transpose(0, 1), v_stage.transpose(0, 1)  # [B, KVH, L, D]
            out = F.scaled_dot_product_attention(qd, keys, values, attn_mask=mask, scale=scale)
            parts.append(out.reshape(nd, -1))
        else:
            # more rows: batched matmuls by hand, several times faster than SDPA here
            keys = k_stage.reshape(num_kv_heads * nd, -1, head_dim)  # [KVH*B, L, D]
            values = v_stage.reshape(num_kv_heads * nd, -1, head_dim)
            qd = q[:nd].view(nd, num_kv_heads, group, head_dim).transpose(0, 1).reshape(-1, group, head_dim)
            scores = torch.baddbmm(mask, qd, keys.transpose(1, 2), alpha=scale)  # [KVH*B, G, L]
            out = torch.bmm(torch.softmax(scores, dim=-1), values)  # [KVH*B, G, D]
            parts.append(out.view(num_kv_heads, nd, group * head_dim).transpose(0, 1).reshape(nd, -1))

    for span in ctx.prefills:
        n = span.end - span.start
        kv_len = span.start_pos + n
        qs = q[span.start : span.end].transpose(0, 1)  # [H, n, D]
        lo = 0 if window is None else max(0, span.start_pos - window + 1)  # the first key any query sees
        if span.kv_slots is None:
            ks, vs = k[span.start : span.end].transpose(0, 1), v[span.start : span.end].transpose(0, 1)
        else:
            ks, vs = k_flat.index_select(1, span.kv_slots[lo:]), v_flat.index_select(1, span.kv_slots[lo:])
        mask = span.mask
        if softcap is not None or (window is not None and kv_len > window):
            mask = _window_mask(torch.arange(span.start_pos, kv_len), torch.arange(lo, kv_len), window)
        if group > 1:  # enable_gqa=True falls back to SDPA's slow math path on CPU
            ks, vs = ks.repeat_interleave(group, dim=0), vs.repeat_interleave(group, dim=0)
        if softcap is not None:
            o = _softcapped_attention(qs, ks, vs, mask, scale, softcap)
            parts.append(o.transpose(0, 1).reshape(n, -1))
            continue
        o = F.scaled_dot_product_attention(
            qs[None], ks[None], vs[None], attn_mask=mask, is_causal=mask is None, scale=scale
        )  # 4-D inputs: the flash kernel for CPU
        parts.append(o[0].transpose(0, 1).reshape(n, -1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
