"""Gemma 3 text decoder: the Llama family's fused linears and paged attention, with Gemma's differences.

- RMSNorms scale by (1 + w) in float32 (UnitOffsetRMSNorm), and each sublayer is wrapped in a pre- and a post-norm:
  h += post_attention_norm(attn(input_norm(h))); h += post_feedforward_norm(mlp(pre_feedforward_norm(h))).
- q and k are RMS-normalised per head before the rotation; scores are scaled by query_pre_attn_scalar^-1/2
  (and tanh-capped if the config says so).
- Sliding-window layers and global layers alternate (`layer_types`), each kind with its own rotary base/scaling.
- GeGLU: gelu(tanh approximation)(gate) * up. Embeddings are multiplied by sqrt(hidden_size); logits are
  tanh-capped if `final_logit_softcapping` is set.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.layers import LayerCache, Rotary, StepContext, UnitOffsetRMSNorm
from engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Gemma3Attention(LlamaAttention):
    def __init__(self, cfg: Any, rotary: Rotary, layer_index: int) -> None:
        super().__init__(cfg, rotary, layer_index)
        self.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        self.softcap = getattr(cfg, "attn_logit_softcapping", None)
        self.q_norm = UnitOffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = UnitOffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)


class GeGLUMLP(LlamaMLP):
    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, ctx.use_quant).split(self.intermediate, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up, ctx.use_quant)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, rotary: Rotary, layer_index: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = UnitOffsetRMSNorm(cfg.hidden_size, eps)
        self.self_attn = Gemma3Attention(cfg, rotary, layer_index)
        self.post_attention_layernorm = UnitOffsetRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = UnitOffsetRMSNorm(cfg.hidden_size, eps)
        self.mlp = GeGLUMLP(cfg)
        self.post_feedforward_layernorm = UnitOffsetRMSNorm(cfg.hidden_size, eps)

    def forward(self, h: torch.Tensor, ctx: StepContext, kv_cache: LayerCache) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), ctx, kv_cache))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h), ctx))


class Gemma3Model(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        self.embed_scale = float(cfg.hidden_size) ** 0.5
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        layer_types = list(cfg.layer_types)
        rotaries = {kind: Rotary(cfg, head_dim, cfg.max_position_embeddings, kind) for kind in sorted(set(layer_types))}
        self.rotaries = nn.ModuleDict(rotaries)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, rotaries[kind], i) for i, kind in enumerate(layer_types)
        )
        self.norm = UnitOffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma3ForCausalLM(LlamaForCausalLM):
    def build_model(self, cfg: Any) -> nn.Module:
        return Gemma3Model(cfg)

    def forward(self, input_ids: torch.Tensor, ctx: StepContext, kv_caches: list[LayerCache]) -> torch.Tensor:
        embed = self.model.embed_tokens.weight
        # the scale in the embedding's dtype, as the reference multiplies it
        h = self.model.embed_tokens(input_ids) * torch.tensor(self.model.embed_scale, dtype=embed.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h = layer(h, ctx, kv_cache)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(h)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap
