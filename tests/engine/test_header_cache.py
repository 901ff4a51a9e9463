"""A GGUF's tokenizer, built once and kept by header_cache: a start from the cache gets the token ids a fresh
conversion gets, a damaged entry is rebuilt, and a cache that cannot be written costs nothing but the time."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from engine import LLM, SamplingParams
from engine.checkpoint.gguf_tokenizer import converted_tokenizer
from engine.checkpoint.source import default_gguf_path, open_checkpoint
from engine.config import EngineConfig
from engine.models.packaged import gemma3_270m_gguf

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "日本語のテキストと中文文本，还有한국어도 있어요。",
    "emoji 🌍🚀👩‍👩‍👧 and  two  spaces\tand a tab\nand a newline",
    "<|im_start|>user\nhi<|im_end|> <start_of_turn>model\n<end_of_turn> <bos><eos>",
    "def f(x):\n    return x ** 2  # ∑ ∫ √",
]


def _entry_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("which", ["default", "gemma3"])
def test_a_cached_start_gets_the_token_ids_of_a_fresh_conversion(which: str, tmp_path: Path) -> None:
    path = default_gguf_path() if which == "default" else gemma3_270m_gguf(EngineConfig().cache_path)
    fresh = open_checkpoint(str(path))  # no cache root: converted, nothing kept
    cold = open_checkpoint(str(path), tmp_path)
    fresh_tok, cold_tok = fresh.tokenizer(), cold.tokenizer()
    assert _entry_files(tmp_path), "the first start wrote an entry"
    warm_tok = open_checkpoint(str(path), tmp_path).tokenizer()
    # the wrapper as transformers builds it given the vocabulary object (which it deep-copies)
    vocabulary, kwargs = converted_tokenizer(path, fresh.metadata, fresh._file[: fresh._data_start])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=vocabulary, **kwargs)
    assert type(fresh_tok) is type(wrapped) and fresh_tok.init_kwargs == wrapped.init_kwargs
    assert fresh_tok.backend_tokenizer.to_str() == wrapped.backend_tokenizer.to_str()
    for tok in (wrapped, cold_tok, warm_tok):
        assert len(tok) == len(fresh_tok) and tok.all_special_tokens == fresh_tok.all_special_tokens
        assert tok.chat_template == fresh_tok.chat_template
        for text in TEXTS:
            ids = fresh_tok.encode(text)
            assert tok.encode(text) == ids and tok.decode(ids) == fresh_tok.decode(ids), text


@pytest.mark.parametrize("which", ["default", "gemma3"])
def test_a_cached_start_generates_what_a_fresh_one_does(which: str, tmp_path: Path) -> None:
    model = "" if which == "default" else str(gemma3_270m_gguf(EngineConfig().cache_path))
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = ["The capital of France is", "日本の首都は", "x " * 700]  # the last past Gemma 3's 512-token window
    texts = []
    for _ in range(2):  # the first start writes the entry, the second reads it
        llm = LLM(model, cache_dir=str(tmp_path), num_kv_blocks=128)
        texts.append([out.outputs[0].text for out in llm.generate(prompts, params)])
        del llm
    assert _entry_files(tmp_path)
    assert texts[0] == texts[1] and all(texts[0])


def test_a_damaged_entry_is_built_again(tmp_path: Path, caplog) -> None:
    path = str(default_gguf_path())
    expected = open_checkpoint(path, tmp_path).tokenizer().encode(TEXTS[1])
    for file in _entry_files(tmp_path):
        file.write_text("{ not json")
    with caplog.at_level(logging.WARNING, logger="engine.checkpoint.header_cache"):
        assert open_checkpoint(path, tmp_path).tokenizer().encode(TEXTS[1]) == expected
    assert caplog.text.count("building it again") == 1
    assert open_checkpoint(path, tmp_path).tokenizer().encode(TEXTS[1]) == expected  # rewritten whole


def test_a_cache_that_cannot_be_written_costs_nothing_but_time(tmp_path: Path) -> None:
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    checkpoint = open_checkpoint(str(default_gguf_path()), blocked / "cache")
    assert checkpoint.tokenizer().encode("hi")


def test_each_header_has_its_own_entry(tmp_path: Path) -> None:
    open_checkpoint(str(default_gguf_path()), tmp_path).tokenizer()
    open_checkpoint(str(gemma3_270m_gguf(EngineConfig().cache_path)), tmp_path).tokenizer()
    assert len(list((tmp_path / "gguf-header").iterdir())) == 2


def test_the_least_recently_used_entries_go_past_the_limit(tmp_path: Path, monkeypatch) -> None:
    from engine.checkpoint import header_cache

    monkeypatch.setattr(header_cache, "MAX_ENTRIES", 1)
    default, gemma = str(default_gguf_path()), str(gemma3_270m_gguf(EngineConfig().cache_path))
    open_checkpoint(default, tmp_path).tokenizer()
    (first,) = (tmp_path / "gguf-header").iterdir()
    open_checkpoint(gemma, tmp_path).tokenizer()
    (second,) = (tmp_path / "gguf-header").iterdir()
    assert second != first and (second / "tokenizer" / header_cache.TOKENIZER_FILE).is_file()
