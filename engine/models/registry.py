"""Maps a Hugging Face config's architecture to our model class."""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.gpt2 import GPT2LMHeadModel
from engine.models.llama import LlamaForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}
MODEL_TYPES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "gpt2": GPT2LMHeadModel,
}


def model_class(hf_config: Any) -> type[nn.Module]:
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    model_type = getattr(hf_config, "model_type", "")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise ValueError(
        f"unsupported architecture {getattr(hf_config, 'architectures', None)} (model_type {model_type!r}); "
        f"supported: {sorted(ARCHITECTURES)}"
    )
