"""Greedy parity with transformers generate, token for token, through batching, chunking, caching, preemption."""

import pytest

from engine import SamplingParams

from tests.support.engine_helpers import assert_pool_full, hf_greedy, make_llm

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [
    "The quick brown fox",
    "Hello world! Streaming tokens over server-sent events is fun. Continuous batching lets many requests",
    "日本語のテキスト",
    "def add(a, b):",
    "Emoji: 😀 🚀",
    "Paged attention stores keys and values in fixed-size blocks. " * 3,
    "a",
    "Numbers 0123456789 and punctuation",
]


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3", "gpt2"])
def model_dir(request):
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture(scope="module")
def expected(model_dir):
    llm = make_llm(model_dir)
    ids = [llm.engine.input_processor.encode_prompt(p) for p in PROMPTS]
    return ids, [hf_greedy(model_dir, p, GREEDY.max_tokens) for p in ids]


def check(llm, expected, prompts_idx=range(len(PROMPTS))):
    ids, refs = expected
    outs = llm.generate([ids[i] for i in prompts_idx], GREEDY, use_tqdm=False)
    for i, out in zip(prompts_idx, outs):
        assert out.token_ids == refs[i], f"prompt {i}: {out.token_ids} != {refs[i]}"
        assert out.finish_reason == "length"
    assert_pool_full(llm)


def test_single_requests(model_dir, expected):
    llm = make_llm(model_dir)
    for i in range(len(PROMPTS)):
        check(llm, expected, [i])


def test_mixed_lengths_in_one_batch(model_dir, expected):
    check(make_llm(model_dir), expected)


def test_chunked_prefill_with_a_small_token_budget(model_dir, expected):
    llm = make_llm(model_dir, max_num_batched_tokens=16, max_num_seqs=8)
    check(llm, expected)


def test_prefix_cache_hits(model_dir, expected):
    llm = make_llm(model_dir)
    check(llm, expected)
    check(llm, expected)  # the same prompts again: full blocks come from the cache
    assert llm.engine.prefix_cache_hit_rate > 0.3


def test_preemption_under_a_tiny_kv_pool(model_dir, expected):
    llm = make_llm(model_dir, num_kv_blocks=36, block_size=4, max_num_seqs=8)
    check(llm, expected)
    assert llm.engine.num_preemptions > 0


def test_real_default_model_single_and_batched(default_llm):
    prompts = ["The capital of France is", "Write a haiku about the sea.", "日本の首都は", "1, 2, 3, 4,"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ids = [default_llm.engine.input_processor.encode_prompt(p) for p in prompts]
    refs = [hf_greedy(default_llm.engine.model_path, p, 16, dtype=default_llm.engine.config.dtype) for p in ids]
    alone = [default_llm.generate([p], params, use_tqdm=False)[0].token_ids for p in ids]
    together = [o.token_ids for o in default_llm.generate(ids, params, use_tqdm=False)]
    assert alone == together
    num_equal = sum(a == r for a, r in zip(alone, refs))
    assert num_equal == len(prompts), list(zip(alone, refs))
    assert_pool_full(default_llm)
