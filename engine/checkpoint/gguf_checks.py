"""What a GGUF's metadata must hold before anything is built from it: the sizes llama.cpp needs, positive integers, as many
layers as its tensors hold, heads that divide, finite positive norm epsilons and rotary bases, token ids inside
the vocabulary. A file that breaks one (damaged, or written by hand) is refused naming the key, instead of being met
as a load that never ends (2^32 layers), a ZeroDivisionError, or a model that loads and writes nonsense."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

# the per-architecture keys that size the model (a count of at most MAX_SIZE: no model has more)
SIZE_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
             "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.dimension_count",
             "attention.sliding_window", "vocab_size")  # fmt: skip
MAX_SIZE = 1 << 31
# what llama.cpp refuses a file without too: a default of the config class (4096 wide, 32 layers) would be met as a
# shape mismatch naming a tensor, not the missing key
REQUIRED_SIZE_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
# A numeric metadata array longer than this is no model's (a vocabulary's token types: 262,144 for Gemma 3):
# transformers' tokenizer conversion reads every array into a Python list (a 200M-value array took 3.9 GB)
MAX_ARRAY_VALUES = 1 << 22
POSITIVE_FLOAT_KEYS = ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "rope.freq_base")
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "eot_token_id", "padding_token_id", "unknown_token_id")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_required(name: str, metadata: Mapping[str, Any]) -> None:
    arch = metadata["general.architecture"]
    for key in REQUIRED_SIZE_KEYS:
        if f"{arch}.{key}" not in metadata:
            raise ValueError(f"{name}: its metadata lacks {arch}.{key}, which sizes the model")


def check_metadata(name: str, metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]]) -> None:
    """name: the file's, for the message; tensor_shapes: by transformers' names (model.layers.N....)."""
    arch = metadata["general.architecture"]

    def refuse(key: str, value: Any, needs: str) -> None:
        shown = f"an array of {len(value):,} values" if isinstance(value, np.ndarray) else repr(value)
        raise ValueError(f"{name}: its metadata gives {key} = {shown}, where {needs}")

    for key, value in metadata.items():
        if isinstance(value, np.ndarray) and len(value) > MAX_ARRAY_VALUES:
            refuse(key, value, f"no model's metadata needs more than {MAX_ARRAY_VALUES:,} (a damaged file?)")
    for key in SIZE_KEYS:
        value = metadata.get(f"{arch}.{key}")
        if value is not None and (type(value) is not int or not 0 < value <= MAX_SIZE):
            refuse(f"{arch}.{key}", value, f"a size is a whole number from 1 to {MAX_SIZE:,}")
    for key in POSITIVE_FLOAT_KEYS:
        value = metadata.get(f"{arch}.{key}")
        if value is not None and (type(value) not in (int, float) or not math.isfinite(value) or value <= 0):
            refuse(f"{arch}.{key}", value, "it is a finite number above 0")
    layers = {int(m.group(1)) for t in tensor_shapes if (m := _LAYER.match(t))}
    num_layers = metadata.get(f"{arch}.block_count")
    if num_layers is not None and layers != set(range(num_layers)):
        refuse(f"{arch}.block_count", num_layers, f"its tensors hold {len(layers)} layers")
    heads, kv_heads = metadata.get(f"{arch}.attention.head_count"), metadata.get(f"{arch}.attention.head_count_kv")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        refuse(f"{arch}.attention.head_count_kv", kv_heads, f"it divides the {heads} query heads")
    tokens = metadata.get("tokenizer.ggml.tokens")
    num_tokens = tokens if isinstance(tokens, int) else None  # the header reader's StringArray: a count
    embedding = tensor_shapes.get("model.embed_tokens.weight")
    if num_tokens is not None and embedding is not None and num_tokens > embedding[0]:
        refuse("tokenizer.ggml.tokens", f"{num_tokens:,} tokens", f"the model embeds {embedding[0]:,}")
    for key in TOKEN_ID_KEYS:
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None and num_tokens is not None and (type(value) is not int or not 0 <= value < num_tokens):
            refuse(f"tokenizer.ggml.{key}", value, f"a token id lies in [0, {num_tokens:,})")
