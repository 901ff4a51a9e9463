"""A GGUF file read in place: its header parsed here, once, without importing transformers (gguf's GGUFReader walks
every vocabulary string through numpy and takes tens of seconds; transformers' table refuses types it cannot
dequantise, such as Q5_0), tensor data memory-mapped and handed out as StoredTensor views,
config and tokenizer rebuilt from the metadata.

Nothing is converted or written: the pages of a tensor are read when its user reads them (the native packing,
once; the eager path, one tensor at a time)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.checkpoint.gguf_checks import check_metadata, check_required
from engine.checkpoint.gguf_names import ROPE_FACTORS, ArchTensors, arch_tensors
from engine.checkpoint.header_cache import HeaderCache
from engine.checkpoint.stored_tensor import StoredTensor, permuted_rows

log = logging.getLogger(__name__)

# numpy views of the float types a GGUF stores values (not blocks) in
_FLOAT_VIEWS = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_MADV_DONTNEED = 4


def _dropper(view: np.ndarray) -> Callable[[], None]:
    """Drops the whole pages inside a read-only file view from this process (re-read from the page cache if
    touched again)."""
    start, end = view.ctypes.data, view.ctypes.data + view.nbytes
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE

    def drop() -> None:
        if last > first:
            _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)

    return drop


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order
    ggml_type: int
    offset: int  # from the start of the data section
    nbytes: int


# the fewest bytes a metadata entry (key length, an empty key, value type, a one-byte value) and a tensor's entry
# (name length, an empty name, dimension count, no dimension, type, offset) can take: a count beyond the file is a
# damaged or truncated header, never a valid one
_LEAST_ENTRY_BYTES = 8 + 4 + 1
_LEAST_TENSOR_BYTES = 8 + 4 + 4 + 8

# metadata value types with a fixed size (struct formats); 8 = string, 9 = array
_VALUE_FORMATS = {0: "B", 1: "b", 7: "?", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 10: "Q", 11: "q", 12: "d"}


class StringArray(int):
    """A metadata array of strings (a vocabulary, a merge table) as its length, the byte length of its longest
    string, and where its entries lie in the header (only the tokenizer's conversion reads the strings)."""

    longest: int
    start: int  # the first entry's length field
    end: int  # past the last entry

    def strings(self, blob: np.ndarray) -> list[str]:
        """The strings, read from the header blob the array was found in (UnicodeDecodeError if one is not UTF-8)."""
        data, length_at, pos = bytes(blob[self.start : self.end]), struct.Struct("<Q").unpack_from, 0
        values = []
        for _ in range(self):
            (length,) = length_at(data, pos)
            values.append(data[pos + 8 : pos + 8 + length].decode("utf-8"))
            pos += 8 + length
        return values


def _read_value(blob: np.ndarray, pos: int, value_type: int) -> tuple[Any, int]:
    """One metadata value and the offset past it; an array of strings as a StringArray."""
    if value_type in _VALUE_FORMATS:
        fmt = "<" + _VALUE_FORMATS[value_type]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if value_type == 8:
        return _read_string(blob, pos)
    if value_type == 9:
        element_type, count = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        if element_type in _VALUE_FORMATS:  # a read-only view of the file: no Python object per element
            end = pos + count * struct.calcsize(_VALUE_FORMATS[element_type])
            if end > len(blob):
                raise struct.error(f"an array of {count:,} values at byte {pos:,} runs past the end of the buffer")
            return blob[pos:end].view(np.dtype("<" + _VALUE_FORMATS[element_type])), end
        if element_type != 8:
            raise ValueError(f"a metadata array of type {element_type}")
        strings, longest, length_at = StringArray(count), 0, struct.Struct("<Q").unpack_from
        strings.start = pos
        for _ in range(count):
            (length,) = length_at(blob, pos)
            pos += 8 + length
            if length > longest:
                longest = length
        if pos > len(blob):
            raise struct.error(f"an array of {count:,} strings at byte {strings.start:,} runs past the end of the "
                               "buffer")
        strings.longest, strings.end = longest, pos
        return strings, pos
    raise ValueError(f"unknown GGUF metadata value type {value_type}")


def _read_string(blob: np.ndarray, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    if pos + 8 + length > len(blob):  # a slice would end at the file's end instead
        raise struct.error(f"a string of {length:,} bytes at byte {pos:,} runs past the end of the buffer")
    return bytes(blob[pos + 8 : pos + 8 + length]).decode("utf-8"), pos + 8 + length


def read_header(blob: np.ndarray) -> tuple[dict[str, Any], list[TensorInfo], int]:
    """The metadata, every tensor's name, shape, type and place, and where the data section starts (GGUF v2 / v3)."""
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError("no GGUF magic bytes")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (Sluice reads versions 2 and 3)")
    counts = ((kv_count, "metadata entries", _LEAST_ENTRY_BYTES), (tensor_count, "tensors", _LEAST_TENSOR_BYTES))
    for count, what, least in counts:
        if count * least > len(blob):
            raise ValueError(f"its header counts {count:,} {what}, more than its {len(blob):,} bytes can hold: "
                             "the file is truncated (an interrupted download or copy?) or damaged")  # fmt: skip
    pos = 24
    metadata: dict[str, Any] = {}
    for i in range(kv_count):
        at = pos
        try:
            key, pos = _read_string(blob, pos)
            (value_type,) = struct.unpack_from("<I", blob, pos)
            metadata[key], pos = _read_value(blob, pos + 4, value_type)
        except UnicodeDecodeError:
            raise ValueError(f"its header is damaged: metadata entry {i + 1} of {kv_count} (byte {at:,}) holds a "
                             "string that is not UTF-8") from None  # fmt: skip
    if "general.architecture" not in metadata:
        raise ValueError("no general.architecture in its metadata")
    table = []
    for j in range(tensor_count):
        at = pos
        try:
            name, pos = _read_string(blob, pos)
        except UnicodeDecodeError:
            raise ValueError(f"its header is damaged: the name of tensor {j + 1} of {tensor_count} (byte {at:,}) "
                             "is not UTF-8") from None  # fmt: skip
        (num_dims,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{num_dims}Q", blob, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * num_dims)
        pos += 4 + 8 * num_dims + 12
        elements = math.prod(dims)
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except ValueError:
            raise ValueError(f"tensor {name!r} has ggml type {ggml_type}, which the gguf package does not know") from None
        if dims and dims[0] % block:  # a row is whole blocks: else its bytes are no whole number of them
            raise ValueError(f"tensor {name!r} has rows of {dims[0]:,} values in {_type_name(ggml_type)}, which "
                             f"stores whole blocks of {block}")  # fmt: skip
        table.append(TensorInfo(name, tuple(reversed(dims)), ggml_type, offset, elements // block * block_bytes))
    alignment = metadata.get("general.alignment", 32)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"its general.alignment is {alignment!r}, where GGUF needs a power of two (32 by default)")
    return metadata, table, -(-pos // alignment) * alignment


def _type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"ggml type {ggml_type}"


class GGUFCheckpoint:
    def __init__(self, path: Path, cache_root: Path | None = None) -> None:
        """cache_root: where the config and tokenizer built from this header are kept between starts (None: not)."""
        self.path = path
        try:
            self._file = np.memmap(path, mode="r", dtype=np.uint8)
            self.metadata, table, self._data_start = read_header(self._file)
            self._header_cache = HeaderCache(cache_root, self._file[: self._data_start])
        except (ValueError, OSError, KeyError, OverflowError, struct.error) as exc:  # UnicodeDecodeError: a ValueError
            data = getattr(self, "_file", None)  # unset when the file could not be mapped
            # a length or offset past the buffer (an OverflowError when past what an index can hold)
            cut = isinstance(exc, OverflowError) or "buffer" in str(exc)
            cut = cut and data is not None and bytes(data[:4]) == b"GGUF"
            why = ("its header runs past the end of the file: the file is truncated (an interrupted download or copy?) "
                   "or damaged") if cut else exc  # fmt: skip
            raise ValueError(f"cannot read {path} as a GGUF file: {why}") from exc
        num_splits = int(self.metadata.get("split.count", 1))
        if num_splits > 1:  # llama.cpp's split files: each holds some of the tensors
            raise ValueError(f"{path.name} is part {int(self.metadata.get('split.no', 0)) + 1} of a GGUF split in "
                             f"{num_splits} files: merge them first (llama-gguf-split --merge FIRST OUT.gguf)")  # fmt: skip
        self.architecture: str = self.metadata["general.architecture"]
        self.arch: ArchTensors = arch_tensors(self.architecture)
        self.tensors: dict[str, StoredTensor] = {}
        self._rope_factors: StoredTensor | None = None
        unknown = []
        for info in table:
            if info.name == ROPE_FACTORS:
                self._rope_factors = self._stored(info)
                continue
            name = self.arch.hf_name(info.name)
            if name is None:
                unknown.append(info.name)
                continue
            if name in self.tensors:
                raise ValueError(f"{path.name}: its header names two tensors {info.name!r}")
            self.tensors[name] = self._stored(info)
        if unknown:
            raise ValueError(
                f"{path.name}: tensors Sluice does not know for architecture {self.architecture!r}: {unknown[:5]}"
            )
        check_required(path.name, self.metadata)
        check_metadata(path.name, self.metadata, {name: t.shape for name, t in self.tensors.items()})
        if self.arch.permuted_qk:
            try:
                self._unpermute_qk()
            except KeyError as error:
                raise ValueError(f"{path.name}: its metadata lacks {error.args[0]}") from None

    def _stored(self, info: TensorInfo) -> StoredTensor:
        type_name = _type_name(info.ggml_type)
        start = self._data_start + info.offset
        if start + info.nbytes > len(self._file):
            raise ValueError(
                f"{self.path} is truncated: tensor {info.name!r} ends at byte {start + info.nbytes:,}, "
                f"the file has {len(self._file):,} (an interrupted download or copy?)"
            )
        raw = self._file[start : start + info.nbytes]
        shape = tuple(int(d) for d in info.shape)
        drop = _dropper(raw)
        if type_name in _FLOAT_VIEWS:
            values = raw.view(_FLOAT_VIEWS[type_name]).reshape(shape)
            if self.arch.norm_offset and info.name.endswith("norm.weight"):
                offset = self.arch.norm_offset
                return StoredTensor(shape, type_name, lambda: values.astype(np.float32) + np.float32(offset), drop)
            return StoredTensor(shape, type_name, lambda: values, drop)
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        rows = raw.reshape(-1, shape[-1] // block * block_bytes)  # [rows, blocks per row * bytes per block]
        return StoredTensor(shape, type_name, lambda: rows, drop)

    def _unpermute_qk(self) -> None:
        """Undo llama.cpp's permutation of q/k rows: per head, [pairs, 2] -> [2, pairs] (rotate-half layout)."""
        heads = int(self.metadata[f"{self.architecture}.attention.head_count"])
        kv_heads = int(self.metadata.get(f"{self.architecture}.attention.head_count_kv", heads))
        for name, tensor in list(self.tensors.items()):
            n_heads = heads if ".q_proj." in name else kv_heads if ".k_proj." in name else 0
            if n_heads:
                rows = tensor.shape[0]
                order = np.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).swapaxes(1, 2).reshape(-1)
                self.tensors[name] = permuted_rows(tensor, order)

    @cached_property
    def hf_config(self) -> Any:
        from engine.checkpoint.gguf_config import config_from_metadata

        try:
            config = config_from_metadata(self.metadata, self.tensors)
        except ValueError as error:
            raise ValueError(f"{self.path.name}: {error}") from error
        if self._rope_factors is not None:
            factors = [float(f) for f in self._rope_factors.to_float().reshape(-1)]
            if not all(math.isfinite(f) and f > 0 for f in factors):
                raise ValueError(f"{self.path.name}: its {ROPE_FACTORS} holds {min(factors)}, where a rotary frequency "
                                 "factor is a finite number above 0")  # fmt: skip
            config.rope_freq_factors = factors
        return config

    def tokenizer(self) -> Any:
        return self._header_cache.tokenizer(self._converted_tokenizer)

    def check_tokenizer(self) -> None:
        """Before any weight is packed: the tokenizer is built last."""
        model = self.metadata.get("tokenizer.ggml.model")
        if model is None or "tokenizer.ggml.tokens" not in self.metadata:
            raise ValueError(f"{self.path.name} holds no tokenizer (its metadata has no tokenizer.ggml.model and "
                             "tokens): Sluice takes a GGUF's tokenizer from the file")  # fmt: skip
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if key in self.metadata and not isinstance(self.metadata[key], StringArray):
                raise ValueError(f"{self.path.name}: its {key} is not an array of strings")
        if model == "gpt2" and "tokenizer.ggml.merges" not in self.metadata:  # BPE: transformers would ask for scores
            raise ValueError(f"{self.path.name}: its 'gpt2' tokenizer needs tokenizer.ggml.merges, which the file lacks")

    def _converted_tokenizer(self) -> tuple[Any, dict[str, Any]]:
        from engine.checkpoint.gguf_tokenizer import converted_tokenizer

        return converted_tokenizer(self.path, self.metadata, self._file[: self._data_start])

    def longest_token_chars(self) -> int | None:
        """At least the characters of the vocabulary's longest string (transformers' conversion keeps the file's
        strings): its UTF-8 bytes."""
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        return tokens.longest if isinstance(tokens, StringArray) else None

    def eos_token_ids(self) -> set[int]:
        eos = self.metadata.get("tokenizer.ggml.eos_token_id")
        ids = {int(eos)} if eos is not None else set()
        eot = self.metadata.get("tokenizer.ggml.eot_token_id")  # end of turn, e.g. Gemma's <end_of_turn>
        if eot is not None:
            ids.add(int(eot))
        return ids
