"""A transformers config rebuilt from a GGUF's metadata, key by key through transformers' own GGUF table (what
its GGUF loading does, without reading the file a second time)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# GGUF architecture -> transformers model_type where the two differ
MODEL_TYPES = {"gemma3": "gemma3_text"}


def config_from_metadata(metadata: Mapping[str, Any], tensors: Mapping[str, Any]) -> Any:
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = metadata["general.architecture"]
    if arch == "llama" and "mistral" in str(metadata.get("general.name", "")).lower():
        arch = "mistral"  # llama.cpp writes Mistral as llama (transformers' rule)
    mapping = GGUF_CONFIG_MAPPING.get(arch)
    if mapping is None:
        raise ValueError(f"unsupported GGUF architecture {arch!r}: transformers has no config mapping for it")
    values: dict[str, Any] = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {}))
    prefix = f"{metadata['general.architecture']}."
    for key, value in metadata.items():
        if key.startswith(prefix) and mapping.get(key[len(prefix) :]) not in (None, -1):
            values[mapping[key[len(prefix) :]]] = value
    if "vocab_size" not in values and "tokenizer.ggml.tokens" in metadata:
        tokens = metadata["tokenizer.ggml.tokens"]  # the header reader gives a count for a string array
        values["vocab_size"] = tokens if isinstance(tokens, int) else len(tokens)
    if "vocab_size" not in values:
        values["vocab_size"] = tensors["model.embed_tokens.weight"].shape[0]
    values["tie_word_embeddings"] = "lm_head.weight" not in tensors
    for key, token in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{token}" in metadata:
            values[key] = int(metadata[f"tokenizer.ggml.{token}"])
    model_type = MODEL_TYPES.get(arch, arch)
    return AutoConfig.for_model(model_type, **values)
