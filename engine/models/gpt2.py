"""GPT-2: learned positions, pre-LayerNorm blocks, GELU (tanh), tied lm_head.

Checkpoints store Conv1D weights as [in, out]; they are transposed into [out, in] linears on load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.layers import LayerCache, Linear, StepContext, copy_weight, paged_attention

def _layer_norm(cfg: Any) -> nn.LayerNorm:
    norm = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
    norm.requires_grad_(False)
    return norm


class GPT2Attention(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=True)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=True)
        self.scale = self.head_dim**-0.5 if cfg.scale_attn_weights else 1.0
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
            self.scale /= layer_idx + 1

    def forward(self, x: torch.Tensor, ctx: StepContext, kv_cache: LayerCache) -> torch.Tensor:
        q, k, v = self.c_attn(x, ctx.use_quant).view(-1, 3 * self.num_heads, self.head_dim).chunk(3, dim=1)
        o = paged_attention(q, k, v, kv_cache, ctx, self.scale)
        return self.c_proj(o, ctx.use_quant)


class GPT2MLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        inner = cfg.n_inner or 4 * cfg.n_embd
        self.c_fc = Linear(cfg.n_embd, inner, bias=True)
        self.c_proj = Linear(inner, cfg.n_embd, bias=True)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x, ctx.use_quant), approximate="tanh"), ctx.use_quant)


class GPT2Block(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = _layer_norm(cfg)
        self.attn = GPT2Attention(cfg, layer_idx)
        self.ln_2 = _layer_norm(cfg)
        self.mlp = GPT2MLP(cfg)

    def forward(self, h: torch.Tensor, ctx: StepContext, kv_cache: LayerCache) -> torch.Tensor:
        h = h + self.attn(self.ln_1(h), ctx, kv_cache)
        return h + self.mlp(self.ln_2(h), ctx)


class GPT2Model(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd, _weight=torch.empty(cfg.vocab_size, cfg.n_embd))
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd, _weight=torch.empty(cfg.n_positions, cfg.n_embd))
        self.requires_grad_(False)
        self.h = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = _layer_norm(cfg)


class GPT2LMHeadModel(nn.Module):
    CONV1D = ("c_attn", "c_proj", "c_fc")  # stored transposed in checkpoints

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        if cfg.activation_function not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
            raise ValueError(f"unsupported GPT-2 activation {cfg.activation_function!r}")
        self.config = cfg
        self.transformer = GPT2Model(cfg)
        self.lm_head = Linear(cfg.n_embd, cfg.vocab_size)
        self.lm_head.weight = self.transformer.wte.weight  # GPT-2 always ties the head to wte
        self.num_layers, self.num_kv_heads, self.head_dim = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head

    def forward(self, input_ids: torch.Tensor, ctx: StepContext, kv_caches: list[LayerCache]) -> torch.Tensor:
        """[T] token ids -> [T, hidden] hidden states before the final norm; writes K/V into kv_caches."""
        h = self.transformer.wte(input_ids) + self.transformer.wpe(ctx.positions)
        for block, kv_cache in zip(self.transformer.h, kv_caches):
            h = block(h, ctx, kv_cache)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[N, hidden] rows to sample -> [N, vocab] float32 logits."""
        return self.lm_head(self.transformer.ln_f(h)).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"
            if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # tied head; old checkpoints store the causal mask as a buffer
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            if name.endswith(".weight") and name.split(".")[-2] in self.CONV1D:
                tensor = tensor.t()
            copy_weight(params[name].data, tensor, name)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
