"""Where a query looks, from a Hugging Face config: rotary position tables (default, linear, llama3 and yarn
kinds, per layer type where the config gives each its own, divided by a GGUF's per-pair frequency factors where it
has them) and sliding windows; shared by the eager layers and the native step."""

from __future__ import annotations

import math
from typing import Any

import torch


def _rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """transformers 5 keeps rope settings in `rope_parameters` (keyed by layer type when the types differ, as in
    Gemma 3); 4.x in `rope_theta` + `rope_scaling` (+ Gemma 3's `rope_local_base_freq` for sliding layers)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params and layer_type is not None and layer_type in params:
        params = dict(params[layer_type])
    elif params and not any(isinstance(v, dict) for v in params.values()):
        params = dict(params)
    elif layer_type == "sliding_attention" and getattr(hf_config, "rope_local_base_freq", None):
        params = {"rope_theta": hf_config.rope_local_base_freq}
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(hf_config: Any, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] and the cos/sin scale factor for the config's rope kind (for the layers
    of `layer_type` when the config gives each type its own)."""
    p = _rope_parameters(hf_config, layer_type)
    kind = p["rope_type"]
    base = float(p["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    factors = getattr(hf_config, "rope_freq_factors", None)  # a GGUF's rope_freqs tensor (gguf_names.ROPE_FACTORS)
    if factors is not None:
        if len(factors) != head_dim // 2:
            raise ValueError(f"the rotary frequency factors (rope_freqs.weight) are {len(factors)}, where the "
                             f"heads' {head_dim} dimensions make {head_dim // 2} rotary pairs")  # fmt: skip
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(p["factor"]), 1.0
    if kind == "llama3":
        factor = float(p["factor"])
        low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_len = float(p["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        factor = float(p["factor"])
        old_len = p.get("original_max_position_embeddings") or hf_config.max_position_embeddings
        beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)
        attention_factor = p.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")

            def get_mscale(scale: float, m: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            if mscale and mscale_all_dim:
                attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            else:
                attention_factor = get_mscale(factor)

        def correction_dim(rotations: float) -> float:
            return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        interpolation = inv_freq / factor
        return interpolation * (1 - extrapolation) + inv_freq * extrapolation, float(attention_factor)
    raise ValueError(f"unsupported rope_type {kind!r} (supported: default, linear, llama3, yarn)")


def rope_tables(
    hf_config: Any, head_dim: int, max_positions: int, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) float32 [max_positions, head_dim] in the rotate-half layout, the sign folded into sin:
    rotate_half(x) * sin == roll(x, half) * [-sin, sin], one roll instead of slices, a negation and a cat."""
    inv_freq, scale = rope_inv_freq(hf_config, head_dim, layer_type)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def layer_window(hf_config: Any, layer_index: int) -> int | None:
    """How many positions back (the query's own included) a layer attends, or None for all: Gemma 3's and
    Qwen's sliding layers (`layer_types`), Mistral's every layer (`sliding_window` alone)."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_index] == "sliding_attention" else None
    return window if getattr(hf_config, "model_type", "") == "mistral" else None
