"""A GGUF's tokenizer: transformers' conversion (its builder for each tokenizer model), given the fields from the
header Sluice has already read.

transformers' own entry, get_gguf_tokenizer, reads the file's metadata again, a Python call per string (0.14 s of a
49k vocabulary's first start, 0.7 s of Gemma 3's 262k); `tokenizer_fields` gives the conversion the same three
values, which tests/engine/test_gguf_tokenizer.py holds to get_gguf_tokenizer's on each kind of file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from engine.checkpoint.gguf_file import StringArray

STRING_ARRAYS_READ = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")  # transformers' reader counts the others
SPECIAL_TOKEN_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                     "pad_token": "padding_token_id"}  # fmt: skip


def tokenizer_fields(metadata: dict[str, Any], header: np.ndarray) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(architecture, tokenizer_dict, tokenizer_config) as transformers' get_gguf_tokenizer gives them."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    def value(key: str) -> Any:
        found = metadata[key]
        if isinstance(found, StringArray):
            return found.strings(header) if key in STRING_ARRAYS_READ else int(found)
        return found.tolist() if isinstance(found, np.ndarray) else found

    tokenizer, tokenizer_config = (
        {name: value(f"tokenizer.{key}") for key, name in renames.items() if f"tokenizer.{key}" in metadata}
        for renames in (GGUF_TOKENIZER_MAPPING["tokenizer"], GGUF_TOKENIZER_MAPPING["tokenizer_config"])
    )
    if tokenizer.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary unless told
        tokenizer_config.setdefault("add_bos_token", True)
    elif tokenizer.get("tokenizer_type") == "gemma4":  # its chat template writes <bos> itself
        tokenizer_config["add_bos_token"] = False
    for name, key in SPECIAL_TOKEN_IDS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return metadata["general.architecture"], tokenizer, tokenizer_config


def converted_tokenizer(path: Path, metadata: dict[str, Any], header: np.ndarray) -> tuple[Any, dict[str, Any]]:
    """The vocabulary (a tokenizers.Tokenizer) and the keyword arguments transformers' fast tokenizer is built with;
    ValueError naming the file for what the conversion cannot build."""
    from transformers.integrations.gguf import convert_gguf_tokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    try:
        architecture, tokenizer_dict, tokenizer_config = tokenizer_fields(metadata, header)
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except KeyError as error:  # the conversion indexes the metadata fields its tokenizer model needs
        fields = {name: f"tokenizer.{key}" for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()}
        missing = fields.get(error.args[0] if error.args else None)
        if missing is None:
            raise
        model = metadata.get("tokenizer.ggml.model")
        raise ValueError(f"{path.name}: its {model!r} tokenizer needs {missing}, which the file lacks") from None
    except Exception as error:  # the tokenizers library refuses the vocabulary (a bare Exception for bad merges)
        why = " ".join(str(error).split())  # one line: some of the library's messages take several
        raise ValueError(f"{path.name}: its tokenizer cannot be built: {why}") from error
    return backend, {**tokenizer_config, **extra}
