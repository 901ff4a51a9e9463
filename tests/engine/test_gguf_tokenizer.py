"""A GGUF's tokenizer fields, read from Sluice's own header read, against transformers' get_gguf_tokenizer (which
reads the file again) on each kind of vocabulary: byte-level BPE with merges (the default model), SentencePiece
without merges (Gemma 3's, and a Llama one that leaves out add_bos_token), and what a bad vocabulary says."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from transformers.integrations.gguf import get_gguf_tokenizer

from engine.checkpoint.gguf_file import StringArray, read_header
from engine.checkpoint.gguf_tokenizer import converted_tokenizer, tokenizer_fields
from engine.checkpoint.source import default_gguf_path
from engine.config import EngineConfig
from engine.models.packaged import gemma3_270m_gguf


def sentencepiece_gguf(path: Path, tokens: list[str | bytes]) -> Path:
    """A header-only Llama file with a SentencePiece vocabulary (scores, token types, no merges, no BOS flag)."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types([2, 3, 3, *([1] * (len(tokens) - 3))])  # unknown, control, control, normal
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def fields_of(path: Path) -> tuple:
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    metadata, _, data_start = read_header(blob)
    return tokenizer_fields(metadata, blob[:data_start])


SPIECE = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a", "ab", "\u2581ab", "\u2581b", "日", "本", "日本"]


@pytest.mark.parametrize("which", ["default", "gemma3", "sentencepiece"])
def test_the_fields_are_transformers_own(which: str, tmp_path: Path) -> None:
    path = {
        "default": default_gguf_path,
        "gemma3": lambda: gemma3_270m_gguf(EngineConfig().cache_path),
        "sentencepiece": lambda: sentencepiece_gguf(tmp_path / "spiece.gguf", SPIECE),
    }[which]()
    ours = fields_of(path)
    assert ours == get_gguf_tokenizer(str(path))
    if which == "sentencepiece":
        assert ours[2]["add_bos_token"] is True  # the file has no flag: llama.cpp's default for SentencePiece


def test_a_string_array_reads_its_strings_from_the_header(tmp_path: Path) -> None:
    path = sentencepiece_gguf(tmp_path / "spiece.gguf", SPIECE)
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    metadata, _, _ = read_header(blob)
    tokens = metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, StringArray) and tokens == len(SPIECE)
    assert tokens.strings(blob) == SPIECE and tokens.longest == len("日本".encode())


def test_a_vocabulary_that_is_not_utf8_is_one_line_naming_the_file(tmp_path: Path) -> None:
    path = sentencepiece_gguf(tmp_path / "bad.gguf", [*SPIECE[:4], b"\xff\xfe", *SPIECE[5:]])
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    metadata, _, data_start = read_header(blob)
    with pytest.raises(ValueError, match=r"^bad.gguf: its tokenizer cannot be built: 'utf-8' codec can't decode"):
        converted_tokenizer(path, metadata, blob[:data_start])
