"""The native forward pass of our Llama model: its weights packed once (Q4_1 linears, Q8_0 embedding and
lm_head, float32 norms and rope tables), then one C++ call for all layers of a step and one for the logits,
each releasing the GIL for its whole run.
"""

from __future__ import annotations

from types import ModuleType

import torch

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
    if attn.head_dim not in (16, 32, 64, 128):
        return "head_dim must be 16, 32, 64 or 128"
    if model.lm_head.bias is not None:
        return "lm_head has a bias"
    return None


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
            model.model.norm.weight.detach().float().contiguous(),
            rotary.cos.float().contiguous(), rotary.sin.float().contiguous(),
        )  # fmt: skip
        for layer in model.model.layers:
            self.impl.add_layer(
                layer.input_layernorm.weight.detach().float().contiguous(),
                layer.post_attention_layernorm.weight.detach().float().contiguous(),
                _q4_args(layer.self_attn.qkv_proj), _q4_args(layer.self_attn.o_proj),
                _q4_args(layer.mlp.gate_up_proj), _q4_args(layer.mlp.down_proj),
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
