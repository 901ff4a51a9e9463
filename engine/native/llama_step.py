"""The native forward pass of our Llama-family models (Llama, Mistral, Qwen 2/3, Gemma 3): weights packed once
(Q4_1 linears, Q8_0 embedding and lm_head, float32 norms and rope tables), then one C++ call for all layers of a
step and one for the logits, each releasing the GIL for its whole run. What a variant changes (q/k norms, Gemma's
sandwich norms, GeGLU, scales, per-layer rope and sliding windows) is read off our model and passed as options.
"""

from __future__ import annotations

from types import ModuleType

import torch

from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.native.packing import GROUP, Q4Packed, pack_q4, pack_q8


def _q4_args(linear: torch.nn.Module) -> list[torch.Tensor]:
    p: Q4Packed = pack_q4(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
    return [p.qs, p.scale, p.minv, p.bias]


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the native step cannot run this model, or None if it can."""
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a Llama-family model"
    cfg = model.config
    attn = model.model.layers[0].self_attn
    if cfg.hidden_size % GROUP or cfg.intermediate_size % GROUP or attn.q_size % GROUP:
        return f"hidden / intermediate / attention sizes must be multiples of {GROUP}"
    if attn.head_dim not in (16, 32, 64, 128, 256):
        return "head_dim must be 16, 32, 64, 128 or 256"
    if model.lm_head.bias is not None:
        return "lm_head has a bias"
    if any(layer.self_attn.softcap is not None for layer in model.model.layers):
        return "attention logit soft-capping"
    return None


def _norm_or_empty(norm: torch.nn.Module | None) -> torch.Tensor:
    return torch.empty(0) if norm is None else norm.scale()


class NativeLlamaStep:
    """Built from a LlamaForCausalLM whose weights are still float32 (the quantisers read exact values)."""

    def __init__(self, ops: ModuleType, model: LlamaForCausalLM) -> None:
        cfg = model.config
        attn = model.model.layers[0].self_attn
        rotary = attn.rotary
        embed = pack_q8(model.model.embed_tokens.weight.detach())
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        head = embed if tied else pack_q8(model.lm_head.weight.detach())
        self.vocab_size = int(cfg.vocab_size)
        self.impl = ops.NativeLlama(
            cfg.hidden_size, cfg.intermediate_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            float(cfg.rms_norm_eps), self.vocab_size, embed.qs, embed.scale, head.qs, head.scale,
            model.model.norm.scale(), rotary.cos.float().contiguous(), rotary.sin.float().contiguous(),
        )  # fmt: skip
        is_gemma = isinstance(model, Gemma3ForCausalLM)
        if is_gemma:
            cap = getattr(cfg, "final_logit_softcapping", None) or 0.0
            self.impl.set_model_options(model.model.embed_scale, attn.scale, True, float(cap))
        for index, layer in enumerate(model.model.layers):
            # Llama's post_attention_layernorm is the norm before the MLP; Gemma's is the one after attention
            before_mlp = layer.pre_feedforward_layernorm if is_gemma else layer.post_attention_layernorm
            self.impl.add_layer(
                layer.input_layernorm.scale(), before_mlp.scale(),
                _q4_args(layer.self_attn.qkv_proj), _q4_args(layer.self_attn.o_proj),
                _q4_args(layer.mlp.gate_up_proj), _q4_args(layer.mlp.down_proj),
            )  # fmt: skip
            layer_attn = layer.self_attn
            own_rotary = layer_attn.rotary is not rotary
            self.impl.set_layer_options(
                index, _norm_or_empty(layer_attn.q_norm), _norm_or_empty(layer_attn.k_norm),
                _norm_or_empty(layer.post_attention_layernorm if is_gemma else None),
                _norm_or_empty(layer.post_feedforward_layernorm if is_gemma else None),
                layer_attn.rotary.cos.float().contiguous() if own_rotary else torch.empty(0),
                layer_attn.rotary.sin.float().contiguous() if own_rotary else torch.empty(0),
                layer_attn.window or 0,
            )  # fmt: skip

    def set_kv_caches(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """The runner's per-layer caches, [KVH, num_blocks, block_size, head_dim], float32 or bfloat16."""
        self.impl.set_kv_caches(k, v)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        slots: torch.Tensor,  # [T] int64 cache slot of each token's K/V
        row_seq: torch.Tensor,  # [T] int32 row of block_tables of each token's sequence
        block_tables: torch.Tensor,  # [S, max_blocks] int32
    ) -> torch.Tensor:
        """[T, hidden] float32 hidden states before the final norm."""
        return self.impl.forward(input_ids, positions, slots, row_seq, block_tables)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return self.impl.logits(hidden.float().contiguous())
