"""A transformers config rebuilt from a GGUF's metadata: key by key through transformers' own GGUF table (what its
GGUF loading does, without reading the file a second time), then completed with the defaults and derived values
the architecture's config class would give it, into transformers' base PreTrainedConfig.

Why not the class itself: importing any model's config class imports transformers' activations and with them
torch.distributed.tensor and sympy (~1 s of a start, under the GIL). tests/engine/test_gguf_config.py holds every
value here to the classes' own, for each architecture and each key a file may leave out."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# GGUF architecture -> transformers model_type where the two differ
MODEL_TYPES = {"gemma3": "gemma3_text"}

_LLAMA_LIKE = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "head_dim": None,
    "num_key_value_heads": None,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
}
_QWEN = {
    **_LLAMA_LIKE,
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "layer_types": None,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}

# transformers 5's class defaults of the values a model reads (sizes, norms, rotary, attention kinds, token ids)
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_LLAMA_LIKE,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
    },
    "mistral": {
        **_LLAMA_LIKE,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
    },
    "qwen2": {k: v for k, v in _QWEN.items() if k != "head_dim"},
    "qwen3": {**_QWEN, "head_dim": 128, "attention_bias": False},
    "gemma3_text": {
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "layer_types": None,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
    },
}


def _heads(v: dict[str, Any]) -> None:
    if "head_dim" in v and v["head_dim"] is None:
        v["head_dim"] = v["hidden_size"] // v["num_attention_heads"]
    if v.get("num_key_value_heads", 0) is None:
        v["num_key_value_heads"] = v["num_attention_heads"]


def _rope(v: dict[str, Any]) -> None:
    v["rope_parameters"] = {"rope_theta": float(v.pop("rope_theta")), "rope_type": "default"}


def _qwen(v: dict[str, Any]) -> None:
    _heads(v)
    _rope(v)
    if not v["use_sliding_window"]:
        v["sliding_window"] = None
    if v["layer_types"] is None:
        window = v["sliding_window"] is not None
        v["layer_types"] = [
            "sliding_attention" if window and i >= v["max_window_layers"] else "full_attention"
            for i in range(v["num_hidden_layers"])
        ]


def _gemma3(v: dict[str, Any]) -> None:
    if v["use_bidirectional_attention"]:
        v["sliding_window"] = v["sliding_window"] // 2 + 1
    pattern = v.pop("sliding_window_pattern", 6)
    v["_sliding_window_pattern"] = pattern
    if v["layer_types"] is None:
        v["layer_types"] = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(v["num_hidden_layers"])
        ]
    v["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": float(v.pop("rope_local_base_freq"))},
        "full_attention": {"rope_type": "default", "rope_theta": float(v.pop("rope_theta"))},
    }


# what each class's own __post_init__ derives from the values it was given
DERIVED: dict[str, Callable[[dict[str, Any]], None]] = {
    "llama": lambda v: (_heads(v), _rope(v)),
    "mistral": lambda v: (_heads(v), _rope(v)),
    "qwen2": _qwen,
    "qwen3": _qwen,
    "gemma3_text": _gemma3,
}


def metadata_values(metadata: Mapping[str, Any], tensors: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(model_type, the config's values that the file states), through transformers' GGUF table."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = metadata["general.architecture"]
    if arch == "llama" and "mistral" in str(metadata.get("general.name", "")).lower():
        arch = "mistral"  # llama.cpp writes Mistral as llama (transformers' rule)
    mapping = GGUF_CONFIG_MAPPING.get(arch)
    if mapping is None or MODEL_TYPES.get(arch, arch) not in DEFAULTS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}: Sluice runs {', '.join(sorted(DEFAULTS))}")
    values: dict[str, Any] = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {}))
    prefix = f"{metadata['general.architecture']}."
    for key, value in metadata.items():
        if key.startswith(prefix) and mapping.get(key[len(prefix) :]) not in (None, -1):
            values[mapping[key[len(prefix) :]]] = value
    model_type = MODEL_TYPES.get(arch, arch)
    key_length = metadata.get(f"{prefix}attention.key_length")
    if "head_dim" in DEFAULTS[model_type] and "head_dim" not in values and key_length is not None:
        values["head_dim"] = key_length  # Qwen 3's (transformers' table leaves it out: its class default is 128)
    if arch == "mistral":
        values["sliding_window"] = None  # llama.cpp runs a Mistral file, written as llama, with full attention
    if "vocab_size" not in values and "tokenizer.ggml.tokens" in metadata:
        tokens = metadata["tokenizer.ggml.tokens"]  # the header reader gives a count for a string array
        values["vocab_size"] = tokens if isinstance(tokens, int) else len(tokens)
    if "vocab_size" not in values:
        values["vocab_size"] = tensors["model.embed_tokens.weight"].shape[0]
    values["tie_word_embeddings"] = "lm_head.weight" not in tensors
    for key, token in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{token}" in metadata:
            values[key] = int(metadata[f"tokenizer.ggml.{token}"])
    return model_type, values


def complete_config(model_type: str, values: Mapping[str, Any]) -> Any:
    """The config the model_type's class would build from `values`, as transformers' base PreTrainedConfig."""
    from transformers.configuration_utils import PreTrainedConfig

    full = {**DEFAULTS[model_type], **values}
    DERIVED[model_type](full)
    try:
        config = PreTrainedConfig(**full)
    except Exception as error:  # its validators (huggingface_hub's strict dataclass): the cause says what is wrong
        raise ValueError(f"its {model_type} config is refused: {error.__cause__ or error}") from error
    for key, value in full.items():  # the few the base class keeps elsewhere or not at all
        if getattr(config, key, None) != value:
            setattr(config, key, value)
    config.model_type = model_type
    return config


def config_from_metadata(metadata: Mapping[str, Any], tensors: Mapping[str, Any]) -> Any:
    return complete_config(*metadata_values(metadata, tensors))
