"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2): RMSNorm, RoPE, GQA, SwiGLU; Qwen 3 adds
an RMSNorm over each query and key head before the rotation; sliding-window layers where the config has them.

q/k/v and gate/up are fused into one linear each; checkpoints are mapped onto the fused weights on load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.layers import LayerCache, Linear, RMSNorm, Rotary, StepContext, copy_weight, paged_attention
from engine.rope import layer_window

# model types whose attention normalises each query and key head (weights q_norm / k_norm)
QK_NORM_MODEL_TYPES = {"qwen3"}

class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, rotary: Rotary, layer_index: int) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Qwen2 always has q/k/v bias and its config has no attention_bias field
        bias = getattr(cfg, "attention_bias", cfg.model_type == "qwen2")
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=bias and cfg.model_type != "qwen2")
        self.rotary = rotary
        self.scale = self.head_dim**-0.5
        self.window = layer_window(cfg, layer_index)
        self.softcap: float | None = None
        has_qk_norm = cfg.model_type in QK_NORM_MODEL_TYPES
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if has_qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if has_qk_norm else None

    def forward(self, x: torch.Tensor, ctx: StepContext, kv_cache: LayerCache) -> torch.Tensor:
        qkv = self.qkv_proj(x, ctx.use_quant).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            qk = self.rotary(qkv[:, : self.num_heads + self.num_kv_heads], ctx)  # one rotation for q and k
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q, k = qkv[:, : self.num_heads], qkv[:, self.num_heads : self.num_heads + self.num_kv_heads]
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
            q, k = self.rotary(qk, ctx).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        o = paged_attention(q, k, v, kv_cache, ctx, self.scale, self.window, self.softcap)
        return self.o_proj(o, ctx.use_quant)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, ctx.use_quant).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up, ctx.use_quant)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, rotary: Rotary, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary, layer_index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, h: torch.Tensor, ctx: StepContext, kv_cache: LayerCache) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h), ctx)


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = Rotary(cfg, head_dim, cfg.max_position_embeddings)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # checkpoint projection name -> (our fused module, index of its shard)
    FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # fmt: skip

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.build_model(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        attn = self.model.layers[0].self_attn
        self.num_layers, self.num_kv_heads, self.head_dim = cfg.num_hidden_layers, attn.num_kv_heads, attn.head_dim

    def build_model(self, cfg: Any) -> nn.Module:
        """The decoder stack (embedding, layers, final norm): where a variant of the family differs."""
        return LlamaModel(cfg)

    def forward(self, input_ids: torch.Tensor, ctx: StepContext, kv_caches: list[LayerCache]) -> torch.Tensor:
        """[T] token ids -> [T, hidden] hidden states before the final norm; writes K/V into kv_caches."""
        h = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h = layer(h, ctx, kv_cache)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[N, hidden] rows to sample -> [N, vocab] float32 logits."""
        return self.lm_head(self.model.norm(h)).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            parts = name.split(".")
            fused = self.FUSED.get(parts[-2]) if len(parts) >= 2 else None
            if fused is not None:
                module_name, shard = fused
                target = ".".join([*parts[:-2], module_name, parts[-1]])
                if target not in params:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                param = params[target]
                sizes = self._shard_sizes(module_name)
                offset = sum(sizes[:shard])
                copy_weight(param.data[offset : offset + sizes[shard]], tensor, name)
                loaded.add(f"{target}#{shard}")
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            copy_weight(params[name].data, tensor, name)
            loaded.add(name)
        self._check_loaded(loaded, params)

    def _shard_sizes(self, module_name: str) -> list[int]:
        attn = self.model.layers[0].self_attn
        if module_name == "qkv_proj":
            return [attn.q_size, attn.kv_size, attn.kv_size]
        return [self.config.intermediate_size] * 2

    def _check_loaded(self, loaded: set[str], params: dict[str, torch.Tensor]) -> None:
        missing = []
        for name in params:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            module_name = name.split(".")[-2]
            if module_name in ("qkv_proj", "gate_up_proj"):
                shards = range(3 if module_name == "qkv_proj" else 2)
                missing += [f"{name}#{s}" for s in shards if f"{name}#{s}" not in loaded]
            elif name not in loaded:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
