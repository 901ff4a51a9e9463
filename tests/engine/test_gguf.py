"""GGUF files read in place: each quant type's grid against the gguf package's own dequantize, our model on a
GGUF against transformers' reading of the same file, the native step on the file's grids, what the log says runs
each type, and clear errors for files Sluice cannot run."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize
from bench.synthetic_gguf import random_blocks, write_llama_gguf

from engine import LLM, SamplingParams
from engine.batch import SeqChunk, StepBatch
from engine.checkpoint.block_grids import UNPACKERS, grid_of
from engine.checkpoint.source import open_checkpoint
from engine.checkpoint.stored_tensor import StoredTensor
from engine.config import EngineConfig
from engine.loader import load_model
from engine.models.packaged import gemma3_270m_gguf
from engine.native import native_ops
from engine.native.native_backend import check_shapes, pack_weights
from engine.rope import rope_inv_freq

from tests.support.engine_helpers import hf_model

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("type_name", sorted(UNPACKERS))
def test_each_grid_is_the_files_own_weights(type_name: str) -> None:
    rng = np.random.default_rng(0)
    n, k = 24, 512
    raw = random_blocks(rng, type_name, n, k)
    grid = grid_of(StoredTensor((n, k), type_name, lambda: raw))
    expected = dequantize(raw, GGMLQuantizationType[type_name])
    assert np.array_equal(grid.dequantize(), expected)  # equal values (Q4_0 / Q5_0 may differ in the sign of 0)
    assert grid.q.shape == (n, k) and grid.scale.dtype == np.float32
    assert grid.q.min() >= (-32 if type_name == "Q6_K" else -128 if type_name == "Q8_0" else 0)


# the types transformers can dequantise too (it has no Q5_0 / Q5_1), so that it can be the reference
MIXED = {"layers": "Q4_K", "attn_v": "Q6_K", "ffn_up": "Q5_K", "attn_q": "Q4_0", "attn_k": "Q4_1",
         "token_embd": "Q8_0", "output": "Q6_K"}  # fmt: skip


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf", MIXED)


@pytest.fixture(scope="module")
def legacy_gguf(tmp_path_factory) -> Path:
    """Q4_0 / Q4_1 / Q4_K layers and a Q8_0 embedding, tied: every tensor on a grid the native kernels hold
    exactly."""
    types = {"layers": "Q4_K", "attn_q": "Q4_0", "attn_k": "Q4_1", "token_embd": "Q8_0"}
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "legacy.gguf", types, tied=True, seed=1)


def full_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Every position's logits of one prompt through the engine's backend (block size 4)."""
    backend = llm.engine.runner.backend
    step = backend.forward(StepBatch([SeqChunk(0, ids, 0, list(range(len(ids) // 4 + 1)), None)]))
    return backend.compute_logits(step.hidden)


def test_eager_model_on_a_gguf_matches_transformers_reading_of_the_same_file(mixed_gguf: Path) -> None:
    llm = LLM(str(mixed_gguf), dtype="float32", quantize="none", block_size=4, num_kv_blocks=64)
    assert llm.engine.runner.backend.name == "eager"
    ids = list(range(100, 160))
    with torch.inference_mode():
        ours = full_logits(llm, ids)
        theirs = hf_model(str(mixed_gguf))(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


@pytest.mark.skipif(native_ops() is None, reason="the native step is not built (make install builds it)")
def test_native_step_runs_a_gguf_on_its_own_grids(legacy_gguf: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        llm = LLM(str(legacy_gguf), block_size=4, num_kv_blocks=128, max_num_seqs=4, precision="exact")
    assert llm.engine.runner.backend.name == "native"
    assert "architecture llama" in caplog.text and all(t in caplog.text for t in ("Q4_0", "Q4_K", "Q8_0"))
    assert "own grid" in caplog.text and "re-quantised" not in caplog.text
    prompts = [[5, 17, 300, 42], list(range(200, 230)), [7] * 9]
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    together = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert alone == together
    # the file's values through the float32 eager reference: the native logits stay within int16 rounding
    reference = LLM(str(legacy_gguf), dtype="float32", quantize="none", block_size=4, num_kv_blocks=64)
    with torch.inference_mode():
        ours, expected = full_logits(llm, prompts[1]), full_logits(reference, prompts[1])
    assert (ours - expected).abs().max() < 2e-2 * expected.abs().max()


@pytest.mark.skipif(native_ops() is None, reason="the native step is not built (make install builds it)")
def test_the_log_names_each_type_and_how_it_runs(mixed_gguf: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        loaded = load_model(EngineConfig(model=str(mixed_gguf), num_kv_blocks=16))
    assert loaded.backend.name == "native"
    messages = [r.getMessage() for r in caplog.records]
    for type_name in ("Q4_K", "Q4_0", "Q4_1", "Q5_K", "Q6_K", "Q8_0"):  # the layers' and the embedding's types
        assert any(type_name in m and "own grid" in m for m in messages), type_name
    # the Q6_K head's scales (one per 16) do not fit the head's Q8 layout (one float16 per 32)
    assert "native step: the embedding / lm_head's Q6_K tensors are re-quantised onto Q8" in messages


def test_q5_files_load_and_run(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "q5.gguf", {"layers": "Q5_1", "attn_v": "Q5_0", "token_embd": "Q5_0"})
    llm = LLM(str(path), block_size=4, num_kv_blocks=32)
    assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids) == GREEDY.max_tokens


@pytest.mark.skipif(native_ops() is None, reason="the native step is not built (make install builds it)")
def test_q5_layers_run_natively_in_the_q5_layout_on_the_files_values(tmp_path: Path, caplog) -> None:
    types = {"layers": "Q5_K", "attn_q": "Q5_0", "attn_k": "Q5_1", "ffn_down": "Q5_0", "token_embd": "Q8_0"}
    path = write_llama_gguf(tmp_path / "q5.gguf", types, tied=True, seed=2)
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        llm = LLM(str(path), block_size=4, num_kv_blocks=128, max_num_seqs=4, precision="exact")
    assert llm.engine.runner.backend.name == "native"
    for type_name in ("Q5_0", "Q5_1", "Q5_K"):
        assert f"{type_name} tensors run on their own grid (Q5 layout)" in caplog.text
    prompts = [[5, 17, 300, 42], list(range(200, 230)), [7] * 9]
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    assert alone == [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    reference = LLM(str(path), dtype="float32", quantize="none", block_size=4, num_kv_blocks=64)
    with torch.inference_mode():
        ours, expected = full_logits(llm, prompts[1]), full_logits(reference, prompts[1])
    assert (ours - expected).abs().max() < 2e-2 * expected.abs().max()


def llama3_rope_factors(head_dim: int, base: float, factor: float, low: float, high: float, old_len: int) -> np.ndarray:
    """What llama.cpp's converter writes as rope_freqs.weight for a Llama 3.1+ rope_scaling (one per rotary pair)."""
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factors = []
    for wavelen in 2 * math.pi / inv_freq:
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_a_llama_3_file_runs_the_rotary_scaling_its_rope_factors_state(tmp_path: Path) -> None:
    """Llama 3.1 / 3.2 files carry their long-context scaling as a rope_freqs.weight tensor: it was refused as a
    tensor Sluice does not know."""
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    factors = llama3_rope_factors(64, 10000.0, *scaling.values())
    assert 1.0 in factors and 8.0 in factors and ((factors > 1) & (factors < 8)).any()  # all three kinds of pair
    types = {"layers": "Q8_0", "token_embd": "Q8_0"}
    scaled = write_llama_gguf(tmp_path / "llama3.gguf", types, num_layers=1, rope_factors=factors)
    plain = write_llama_gguf(tmp_path / "plain.gguf", types, num_layers=1)
    cfg = open_checkpoint(str(scaled)).hf_config
    broken = write_llama_gguf(tmp_path / "zero.gguf", types, num_layers=1, rope_factors=np.where(factors > 4, 0, factors))
    with pytest.raises(ValueError, match=r"zero.gguf: its rope_freqs.weight holds 0.0, where a rotary frequency factor"):
        open_checkpoint(str(broken)).hf_config
    llama3 = SimpleNamespace(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, **scaling})
    torch.testing.assert_close(rope_inv_freq(cfg, 64)[0], rope_inv_freq(llama3, 64)[0], rtol=1e-6, atol=0)
    ids = list(range(100, 400))  # far enough for the low frequencies' angles to differ
    exact = {"precision": "exact"}  # int16 activations: within their rounding of the float32 reference
    native, eager, unscaled = (
        LLM(str(path), block_size=4, num_kv_blocks=128, **kwargs)
        for path, kwargs in ((scaled, exact), (scaled, {"dtype": "float32", "quantize": "none"}), (plain, exact))
    )
    assert native.engine.runner.backend.name == "native" and eager.engine.runner.backend.name == "eager"
    with torch.inference_mode():
        ours, expected, without = (full_logits(llm, ids) for llm in (native, eager, unscaled))
    assert (ours - expected).abs().max() < 2e-2 * expected.abs().max()
    assert (ours - without).abs().max() > 10 * (ours - expected).abs().max()


def test_a_vocabulary_that_is_not_a_whole_number_of_tiles_runs_on_the_files_grid(tmp_path: Path, caplog) -> None:
    """49,153 tokens (a fine-tune's added pad token): the Q8_0 embedding and head were re-quantised onto Q8."""
    path = write_llama_gguf(tmp_path / "odd.gguf", {"layers": "Q8_0", "token_embd": "Q8_0", "output": "Q8_0"},
                            num_layers=1, extra_tokens=1)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        llm = LLM(str(path), block_size=4, num_kv_blocks=64, precision="exact")
    assert llm.engine.runner.backend.name == "native" and "re-quantised" not in caplog.text
    reference = LLM(str(path), dtype="float32", quantize="none", block_size=4, num_kv_blocks=64)
    ids = [5, 17, 300, 49152, 42]  # the added token among them
    with torch.inference_mode():
        ours, expected = full_logits(llm, ids), full_logits(reference, ids)
    assert ours.shape[-1] == expected.shape[-1] == 49153
    assert (ours - expected).abs().max() < 2e-2 * expected.abs().max()


def test_the_config_comes_from_the_metadata(mixed_gguf: Path) -> None:
    checkpoint = open_checkpoint(str(mixed_gguf))
    cfg = checkpoint.hf_config
    assert (cfg.model_type, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == ("llama", 256, 512, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (4, 2, False)
    assert checkpoint.tensors["model.layers.1.mlp.down_proj.weight"].type_name == "Q4_K"
    assert checkpoint.tokenizer().chat_template


def one_tensor_gguf(path: Path, architecture: str, fields: dict[str, int] | None = None) -> Path:
    """A GGUF of one float tensor and no tokenizer, with these integer metadata fields."""
    writer = GGUFWriter(str(path), architecture)
    for key, value in (fields or {}).items():
        writer.add_uint16(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_files_sluice_cannot_run_get_errors_that_name_why(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="GGUF"):
        load_model(EngineConfig(model=str(junk)))
    falcon = one_tensor_gguf(tmp_path / "falcon.gguf", "falcon")
    with pytest.raises(ValueError, match="falcon"):
        load_model(EngineConfig(model=str(falcon)))


def test_a_tokenizer_lacking_metadata_and_a_cache_it_cannot_write_are_named(tmp_path: Path) -> None:
    no_merges = write_llama_gguf(tmp_path / "no-merges.gguf", {"layers": "Q8_0"}, hidden=64, intermediate=128,
                                 num_layers=1, with_merges=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"needs tokenizer.ggml.merges, which the file lacks"):
        load_model(EngineConfig(model=str(no_merges)))  # said before its weights are packed
    no_tokenizer = open_checkpoint(str(write_llama_gguf(tmp_path / "no-tokenizer.gguf", {"layers": "Q8_0"}, hidden=64,
                                                        intermediate=128, num_layers=1)))  # fmt: skip
    del no_tokenizer.metadata["tokenizer.ggml.model"]  # what a file without one reads as
    with pytest.raises(ValueError, match="no-tokenizer.gguf holds no tokenizer"):
        no_tokenizer.check_tokenizer()
    no_tokenizer.metadata["tokenizer.ggml.model"] = "gpt2"
    no_tokenizer.metadata["tokenizer.ggml.merges"] = np.arange(3, dtype=np.int32)  # numbers, where strings belong
    with pytest.raises(ValueError, match="no-tokenizer.gguf: its tokenizer.ggml.merges is not an array of strings"):
        no_tokenizer.check_tokenizer()
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with pytest.raises(ValueError, match="cannot assemble Gemma 3 270M in the cache_dir"):
        gemma3_270m_gguf(not_a_folder / "cache")


def test_the_packaged_gemma_is_joined_once_and_says_so(tmp_path: Path, caplog) -> None:
    """Its first start writes ~240 MB into the cache: a line in the log names where, once."""
    with caplog.at_level(logging.INFO, logger="engine.models.packaged"):
        path = gemma3_270m_gguf(tmp_path)
        assert gemma3_270m_gguf(tmp_path) == path and path.parent == tmp_path
    joins = [r.getMessage() for r in caplog.records if "joining Gemma 3 270M" in r.getMessage()]
    assert len(joins) == 1 and str(path) in joins[0] and "4 chunks" in joins[0]


def test_a_truncated_file_says_so(mixed_gguf: Path, tmp_path: Path) -> None:
    """An interrupted download: the header and tensor table are whole, the data is not."""
    cut = tmp_path / "cut.gguf"
    data = mixed_gguf.read_bytes()
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ValueError, match="cut.gguf is truncated: tensor '.+' ends at byte"):
        open_checkpoint(str(cut))


def test_a_layer_type_without_a_kernel_is_refused_unless_asked_to_requantize(tmp_path: Path, caplog) -> None:
    """A second rounding of the file's weights onto Q4 makes greedy tokens drift from the file's: by request only."""
    path = write_llama_gguf(tmp_path / "tq.gguf", {"layers": "TQ1_0", "token_embd": "Q8_0"}, num_layers=1)
    with pytest.raises(ValueError, match=r'TQ1_0 weights have no native kernel .* quantize = "none" .* "requantize"'):
        load_model(EngineConfig(model=str(path), num_kv_blocks=16))
    with caplog.at_level(logging.INFO):
        loaded = load_model(EngineConfig(model=str(path), num_kv_blocks=16, quantize="requantize"))
    assert loaded.backend.name == "native"
    assert any("TQ1_0 tensors are re-quantised onto Q4" in r.getMessage() for r in caplog.records)
    assert load_model(EngineConfig(model=str(path), num_kv_blocks=16, quantize="none")).backend.name == "eager"


def test_a_file_cut_inside_its_header_says_so(mixed_gguf: Path, tmp_path: Path) -> None:
    for num_bytes in (4, 2000):
        cut = tmp_path / f"cut{num_bytes}.gguf"
        cut.write_bytes(mixed_gguf.read_bytes()[:num_bytes])
        with pytest.raises(ValueError, match=r"the file is truncated \(an interrupted download or copy\?\) or damaged"):
            open_checkpoint(str(cut))


def test_a_damaged_header_is_named_where_it_is_damaged(mixed_gguf: Path, tmp_path: Path) -> None:
    """A full-size file whose header was overwritten: a count past what the file holds, a key longer than the file,
    or a key's bytes that are not UTF-8 (they raised a bare decode error, or said only that the file was cut)."""
    data = bytearray(mixed_gguf.read_bytes())
    counts = tmp_path / "counts.gguf"
    counts.write_bytes(data[:8] + (2**62).to_bytes(8, "little") + data[16:])  # the tensor count
    with pytest.raises(ValueError, match=f"counts {2**62:,} tensors, more than its {len(data):,} bytes can hold"):
        open_checkpoint(str(counts))
    long_key = tmp_path / "long_key.gguf"
    long_key.write_bytes(data[:24] + (2**62).to_bytes(8, "little") + data[32:])  # the first key's length
    with pytest.raises(ValueError, match="its header runs past the end of the file: the file is truncated"):
        open_checkpoint(str(long_key))
    key_length = int.from_bytes(data[24:32], "little")
    data[32 : 32 + key_length] = b"\xff" * key_length  # the first metadata key
    bad_key = tmp_path / "key.gguf"
    bad_key.write_bytes(data)
    with pytest.raises(ValueError, match=r"damaged: metadata entry 1 of \d+ \(byte 24\) holds a string that is not UTF-8"):
        open_checkpoint(str(bad_key))


def test_a_gguf_lacking_metadata_is_named(tmp_path: Path) -> None:
    """As llama.cpp does: a class default (32 layers of 4096) would be met as some tensor's wrong shape."""
    with pytest.raises(ValueError, match="bare.gguf: its metadata lacks llama.block_count, which sizes the model"):
        open_checkpoint(str(one_tensor_gguf(tmp_path / "bare.gguf", "llama")))
    sizes = {"llama.block_count": 1, "llama.embedding_length": 32, "llama.feed_forward_length": 64}
    with pytest.raises(ValueError, match="its metadata lacks llama.attention.head_count"):
        open_checkpoint(str(one_tensor_gguf(tmp_path / "no-heads.gguf", "llama", sizes)))


def test_a_split_gguf_is_named_and_a_gguf_by_any_name_opens(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "m.gguf", {"layers": "Q8_0"}, hidden=64, intermediate=128, num_layers=1)
    upper = tmp_path / "M.GGUF"
    upper.write_bytes(path.read_bytes())  # llama.cpp opens a file by its magic bytes, not its name
    assert open_checkpoint(str(upper)).architecture == "llama"
    (tmp_path / "weights.bin").write_bytes(b"PK\x03\x04")  # neither the name nor the magic of a GGUF
    with pytest.raises(ValueError, match="unsupported model file"):
        open_checkpoint(str(tmp_path / "weights.bin"))
    split = one_tensor_gguf(tmp_path / "m-00001-of-00002.gguf", "llama", {"split.no": 0, "split.count": 2})
    with pytest.raises(ValueError, match="part 1 of a GGUF split in 2 files: merge them first"):
        open_checkpoint(str(split))


def test_weights_that_disagree_with_the_metadata_or_are_missing_are_named(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "m.gguf", {"layers": "Q8_0"}, hidden=64, intermediate=128, num_layers=1)
    checkpoint = open_checkpoint(str(path))
    checkpoint.metadata["llama.feed_forward_length"] = 256  # what a file whose header lies says
    with pytest.raises(ValueError, match=r"mlp.gate_proj.weight is \(128, 64\), the config makes it \(256, 64\)"):
        check_shapes(checkpoint.hf_config, checkpoint.tensors)
    ops = native_ops()
    del checkpoint.tensors["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match=r"checkpoint is missing weights: \['model.layers.0.mlp.down_proj.weight'\]"):
        pack_weights(ops, checkpoint.tensors)


@pytest.mark.parametrize("which", ["default", "gemma3"])
def test_the_headers_longest_token_bounds_the_tokenizers(which: str) -> None:
    """The prompt check's characters per token come from the header (its longest string's bytes) instead of
    walking the converted vocabulary: never fewer than the vocabulary's longest string has characters."""
    from engine.checkpoint.gguf_file import StringArray
    from engine.checkpoint.source import default_gguf_path
    from engine.input_processor import InputProcessor
    from engine.models.packaged import gemma3_270m_gguf

    config = EngineConfig()
    path = default_gguf_path() if which == "default" else gemma3_270m_gguf(config.cache_path)
    checkpoint = open_checkpoint(str(path), config.cache_path)
    tokens = checkpoint.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, StringArray) and tokens == checkpoint.hf_config.vocab_size  # still the count
    tokenizer = checkpoint.tokenizer()
    longest = max(len(t) for t in tokenizer.get_vocab())
    assert longest <= checkpoint.longest_token_chars() <= 4 * longest
    processor = InputProcessor(tokenizer, len(tokenizer), 128, (), 4, checkpoint.longest_token_chars())
    assert processor.max_prompt_chars == 128 * checkpoint.longest_token_chars()
    assert InputProcessor(tokenizer, len(tokenizer), 128).max_prompt_chars == 128 * longest
