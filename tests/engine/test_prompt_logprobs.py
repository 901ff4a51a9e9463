"""Prompt logprobs (scoring): every prompt position against the reference model, through chunked prefill,
past the prefix cache, and across preemption."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams

from tests.support.engine_helpers import assert_pool_full, hf_model, make_llm

PROMPT_LEN = 70
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path):
    return hf_model(str(tiny_llama_dir))


def reference_logprobs(reference, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row i is the distribution of the token at position i + 1."""
    with torch.inference_mode():
        table = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    return table


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def check_against_reference(reference, prompt: list[int], scored: list, num_top: int) -> None:
    assert len(scored) == len(prompt) and scored[0] is None
    table = reference_logprobs(reference, prompt)
    expected = table.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor([s.logprob for s in scored[1:]]), expected, atol=2e-4, rtol=1e-4)
    for position, entry in enumerate(scored[1:]):
        assert [token for token, _ in entry.top_logprobs] == table[position].topk(num_top).indices.tolist()
        assert entry.token_id == prompt[position + 1]


def test_prompt_logprobs_match_the_reference_through_chunked_prefill(tiny_llama_dir: Path, reference) -> None:
    # 70-token prompts in 16-token chunks: every chunk scores its rows, the last one also samples.
    llm = make_llm(tiny_llama_dir, block_size=16, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = random_prompts(3, PROMPT_LEN, llm.engine.vocab_size)
    params = SamplingParams(max_tokens=3, prompt_logprobs=2, **GREEDY)
    results = llm.generate(prompts, params, use_tqdm=False)
    for prompt, result in zip(prompts, results):
        check_against_reference(reference, prompt, result.prompt_logprobs, 2)
        assert len(result.token_ids) == 3
    plain = llm.generate(prompts, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert [r.token_ids for r in plain] == [r.token_ids for r in results]  # scoring changes no output
    assert all(r.prompt_logprobs is None for r in plain)
    assert_pool_full(llm)


def test_a_prefix_cache_hit_does_not_skip_the_scoring(tiny_llama_dir: Path, reference) -> None:
    llm = make_llm(tiny_llama_dir, block_size=16, enable_prefix_caching=True)
    (prompt,) = random_prompts(1, PROMPT_LEN, llm.engine.vocab_size, seed=1)
    warm = llm.generate(prompt, SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)[0]
    again = llm.generate(prompt, SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)[0]
    assert again.num_cached_tokens >= 64  # the prompt's full blocks are cached now
    scored = llm.generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=1, **GREEDY), use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0
    check_against_reference(reference, prompt, scored.prompt_logprobs, 1)
    assert scored.token_ids == warm.token_ids
    after = llm.generate(prompt, SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)[0]
    assert after.num_cached_tokens >= 64  # scoring requests leave the cache usable by others
    assert_pool_full(llm)


def test_scoring_survives_preemption(tiny_llama_dir: Path, reference) -> None:
    # 12 blocks of 16 tokens hold fewer than three of these requests at their full length: some are
    # preempted and recomputed, and their prompts are scored once, in order.
    llm = make_llm(tiny_llama_dir, block_size=16, num_kv_blocks=12, max_num_batched_tokens=32, max_num_seqs=4)
    prompts = random_prompts(4, 40, llm.engine.vocab_size, seed=2)
    results = llm.generate(prompts, SamplingParams(max_tokens=40, prompt_logprobs=0, **GREEDY), use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    for prompt, result in zip(prompts, results):
        check_against_reference(reference, prompt, result.prompt_logprobs, 0)
        assert all(entry.top_logprobs == [] for entry in result.prompt_logprobs[1:])
    assert_pool_full(llm)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_are_refused(value: object) -> None:
    with pytest.raises(InvalidRequest) as error:
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]
    assert error.value.param == "prompt_logprobs"
