"""A Hugging Face model folder: config.json, a tokenizer, and safetensors (or pytorch_model*.bin) weights,
opened lazily: a tensor is read when its user asks for it."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from engine.checkpoint.stored_tensor import StoredTensor

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
_TYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _type_name(dtype: torch.dtype | str, name: str) -> str:
    """A torch dtype or a safetensors dtype string ("F32", "BF16", ...) as a GGML type name."""
    type_name = _TYPE_NAMES.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype
    if type_name not in _TYPE_NAMES.values():
        raise ValueError(f"weight {name!r} is {dtype}: Sluice reads float32, float16 and bfloat16 checkpoints")
    return type_name


class FolderCheckpoint:
    def __init__(self, path: Path) -> None:
        if not (path / "config.json").is_file():
            raise ValueError(f"not a Hugging Face model folder (no config.json): {path}")
        self.path = path

    @cached_property
    def tensors(self) -> dict[str, StoredTensor]:
        """Every weight, by name, unread."""
        path, tensors = self.path, {}
        files = sorted(path.glob("*.safetensors"))
        if files:
            self._check_shards()
            for file in files:
                try:
                    with safe_open(file, framework="pt") as f:
                        for name in f.keys():
                            sl = f.get_slice(name)
                            type_name = _type_name(sl.get_dtype(), name)
                            tensors[name] = StoredTensor(tuple(sl.get_shape()), type_name, *self._readers(file, name))
                except (SafetensorError, OSError) as error:
                    raise ValueError(f"cannot read {file}: {error} (a truncated or corrupt file?)") from error
            return tensors
        bins = sorted(path.glob("pytorch_model*.bin"))
        if not bins:
            raise ValueError(f"no *.safetensors or pytorch_model*.bin weights in {path}")
        for file in bins:  # a pickle cannot be read lazily: these files are small legacy checkpoints
            for name, tensor in torch.load(file, map_location="cpu", weights_only=True).items():
                tensors[name] = StoredTensor(tuple(tensor.shape), _type_name(tensor.dtype, name), lambda t=tensor: t)
        return tensors

    def _check_shards(self) -> None:
        """A sharded checkpoint's index names its files: one missing (an interrupted download) is named, not met
        later as a weight that is not there."""
        index = self.path / "model.safetensors.index.json"
        if not index.is_file():
            return
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"cannot read {index}: {error!r}") from error
        missing = sorted(shard for shard in shards if not (self.path / shard).is_file())
        if missing:
            raise ValueError(f"{self.path} lacks {len(missing)} of the {len(shards)} weight files its index names: "
                             f"{missing} (an interrupted download?)")  # fmt: skip

    @staticmethod
    def _readers(file: Path, name: str) -> tuple[Callable[[], torch.Tensor], None, Callable[[int, int], torch.Tensor]]:
        """(the whole tensor, no release, rows [start, end) alone): safetensors reads a slice without the rest."""

        def read() -> torch.Tensor:
            with safe_open(file, framework="pt") as f:
                return f.get_tensor(name)

        def read_rows(start: int, end: int) -> torch.Tensor:
            with safe_open(file, framework="pt") as f:
                return f.get_slice(name)[start:end]

        return read, None, read_rows

    @property
    def architecture(self) -> str:
        return str((getattr(self.hf_config, "architectures", None) or [self.hf_config.model_type])[0])

    @cached_property
    def hf_config(self) -> Any:
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(self.path)
        except (OSError, ValueError) as error:  # a truncated config.json, an unknown model_type
            raise ValueError(f"cannot read {self.path / 'config.json'}: {error}") from error

    def check_tokenizer(self) -> None:
        """Before any weight is packed: the tokenizer is built last."""
        if not any((self.path / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"{self.path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): Sluice takes "
                             "a folder's tokenizer from the folder")  # fmt: skip

    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def longest_token_chars(self) -> int | None:
        return None  # counted from the tokenizer's vocabulary

    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()

        def add(value: Any) -> None:
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))

        add(getattr(self.hf_config, "eos_token_id", None))
        if (self.path / "generation_config.json").is_file():
            from transformers import GenerationConfig

            add(GenerationConfig.from_pretrained(self.path).eos_token_id)
        return ids
