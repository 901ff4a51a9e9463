"""A GGUF whose metadata no model can mean, or that lacks a tensor, is refused with a ValueError naming the file and
what is wrong, at once: never a load that never ends, a bare KeyError or ZeroDivisionError, or a model that loads
and writes nonsense. A large numeric metadata array costs no memory."""

from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from bench.synthetic_gguf import write_llama_gguf
from engine.checkpoint.gguf_checks import check_metadata
from engine.checkpoint.source import open_checkpoint
from engine.config import EngineConfig
from engine.loader import load_model

DROP = object()


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "small.gguf", {"layers": "Q8_0"}, hidden=64,
                            intermediate=128, num_layers=2)  # fmt: skip


def rewritten(source: Path, path: Path, fields: dict[str, Any], drop_tensors: tuple[str, ...] = ()) -> Path:
    """source with these metadata fields replaced ((value, GGUFValueType), or DROP) and these tensors left out."""
    reader = GGUFReader(str(source))
    writer = GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in fields:
            continue
        vtype = field.types[0]
        writer.add_key_value(name, field.contents(), vtype, field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    for name, spec in fields.items():
        if spec is not DROP:
            value, vtype = spec
            writer.add_key_value(name, value, vtype, GGUFValueType.UINT8 if vtype == GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        if tensor.name not in drop_tensors:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


U32, F32, STR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"llama.block_count": (2**32 - 1, U32)}, r"llama.block_count = 4294967295, where a size is a whole number"),
        ({"llama.block_count": (3, U32)}, r"llama.block_count = 3, where its tensors hold 2 layers"),
        ({"llama.attention.head_count_kv": (3, U32)}, r"head_count_kv = 3, where it divides the 4 query heads"),
        ({"llama.attention.head_count": (0, U32)}, r"head_count = 0, where a size is a whole number from 1"),
        ({"llama.context_length": (0, U32)}, r"context_length = 0, where a size is a whole number from 1"),
        ({"llama.context_length": (4096.0, F32)}, r"context_length = 4096.0, where a size is a whole number"),
        ({"llama.embedding_length": ("64", STR)}, r"embedding_length = '64', where a size is a whole number"),
        ({"llama.attention.layer_norm_rms_epsilon": (float("nan"), F32)}, r"epsilon = nan, where it is a finite"),
        ({"llama.rope.freq_base": (-1.0, F32)}, r"rope.freq_base = -1.0, where it is a finite number above 0"),
        ({"tokenizer.ggml.eos_token_id": (2**32 - 1, U32)}, r"eos_token_id = 4294967295, where a token id lies in"),
        ({"general.alignment": (0, U32)}, r"general.alignment is 0, where GGUF needs a power of two"),
        ({"llama.rope.dimension_count": (63, U32)}, r"bad.gguf: its llama config is refused: RoPE requires an even"),
    ],
)
def test_metadata_no_model_can_mean_is_refused_naming_the_key(small_gguf: Path, tmp_path: Path, fields, message) -> None:
    path = rewritten(small_gguf, tmp_path / "bad.gguf", fields)
    started = time.monotonic()
    with pytest.raises(ValueError, match=message):
        load_model(EngineConfig(model=str(path), num_kv_blocks=16))
    assert time.monotonic() - started < 30  # 2^32 layers: the load was walking them for good


def test_a_file_lacking_a_tensor_or_with_a_vocabulary_larger_than_its_model_is_named(small_gguf: Path, tmp_path: Path) -> None:
    no_norm = rewritten(small_gguf, tmp_path / "no-norm.gguf", {}, drop_tensors=("output_norm.weight",))
    with pytest.raises(ValueError, match=r"no-norm.gguf cannot be run: KeyError: model.norm.weight"):
        load_model(EngineConfig(model=str(no_norm), num_kv_blocks=16))
    tokens = open_checkpoint(str(small_gguf)).metadata["tokenizer.ggml.tokens"]
    shapes = {"model.embed_tokens.weight": (tokens - 1, 64)}
    with pytest.raises(ValueError, match=f"tokens = '{tokens:,} tokens', where the model embeds {tokens - 1:,}"):
        check_metadata("m.gguf", {"general.architecture": "llama", "tokenizer.ggml.tokens": tokens}, shapes)


def test_a_size_that_is_not_an_integer_is_refused() -> None:
    for value in (True, 2.0, "2", np.array([2, 2], dtype=np.uint32)):
        with pytest.raises(ValueError, match=r"m.gguf: its metadata gives llama.attention.head_count = .* a size"):
            check_metadata("m.gguf", {"general.architecture": "llama", "llama.attention.head_count": value}, {})


def test_a_numeric_metadata_array_is_a_view_of_the_file_and_a_huge_one_is_refused(
    small_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was a Python list: 26 times its bytes in memory (a 200 MB array took 5.4 GB); transformers' tokenizer
    conversion still reads every array into a list, so an array no model needs is refused."""
    values = np.arange(1 << 16, dtype=np.uint8)
    path = rewritten(small_gguf, tmp_path / "array.gguf", {"general.extra": (values.tolist(), GGUFValueType.ARRAY)})
    read = open_checkpoint(str(path)).metadata["general.extra"]
    assert isinstance(read, np.ndarray) and not read.flags.owndata and np.array_equal(read, values)
    monkeypatch.setattr("engine.checkpoint.gguf_checks.MAX_ARRAY_VALUES", 60_000)  # past the token types
    with pytest.raises(ValueError, match=r"general.extra = an array of 65,536 values, where no model's metadata"):
        open_checkpoint(str(path))


def test_a_quantised_row_that_is_not_whole_blocks_is_named(small_gguf: Path, tmp_path: Path) -> None:
    """A header can say any width; a row of a block type is whole blocks (it was "cannot reshape array")."""
    data = bytearray(small_gguf.read_bytes())
    at = data.index(b"blk.0.ffn_up.weight") + len(b"blk.0.ffn_up.weight")
    assert struct.unpack_from("<IQ", data, at) == (2, 64)  # Q8_0: rows of 64 values, two blocks of 32
    struct.pack_into("<Q", data, at + 4, 48)
    (path := tmp_path / "width.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_up.weight' has rows of 48 values in Q8_0, which stores "
                                         r"whole blocks of 32"):  # fmt: skip
        open_checkpoint(str(path))
