"""n > 1: one prefill of the prompt's full blocks, n choices forked from them by reference count, each choice
sampled with seed + i, finishing on its own and freeing its blocks."""

from __future__ import annotations

import dataclasses

import pytest

from engine import SamplingParams
from engine.errors import InvalidRequest

from tests.support.engine_helpers import assert_pool_full, make_llm

PROMPT = list(range(10, 40))  # 30 tokens: 7 full blocks of 4 shared, the 8th (2 tokens) computed by each choice
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)


def choice_tokens(result) -> list[list[int]]:
    return [choice.token_ids for choice in result.outputs]


def test_seeded_choices_are_reproducible_and_choice_i_samples_with_seed_plus_i(llm):
    params = dataclasses.replace(SEEDED, n=4)
    first = llm.generate([PROMPT], params, use_tqdm=False)[0]
    again = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert choice_tokens(first) == choice_tokens(again)
    assert len({tuple(t) for t in choice_tokens(first)}) == 4  # different seeds, different samples
    for i, tokens in enumerate(choice_tokens(first)):
        alone = llm.generate([PROMPT], dataclasses.replace(SEEDED, seed=SEEDED.seed + i), use_tqdm=False)[0]
        assert alone.token_ids == tokens
    assert first.text == first.outputs[0].text and first.token_ids == first.outputs[0].token_ids


def test_greedy_choices_match_greedy_n1_and_short_prompts_need_no_fork(llm):
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for prompt in (PROMPT, [5, 6, 7]):  # 3 tokens fit in one block: the choices compute them each
        single = llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids
        many = llm.generate([prompt], dataclasses.replace(greedy, n=3), use_tqdm=False)[0]
        assert choice_tokens(many) == [single] * 3


def test_the_prompt_is_computed_once_and_its_full_blocks_are_shared(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)  # an empty prefix cache
    engine = llm.engine
    fed: list[tuple[int, int, int]] = []  # (seq_id, start_pos, num_tokens) of every chunk the runner is given
    run = engine.runner.run

    def counting_run(batch):
        fed.extend((c.seq_id, c.start_pos, c.num_tokens) for c in batch.chunks)
        return run(batch)

    engine.runner.run = counting_run
    try:
        engine.add_request("r", PROMPT, dataclasses.replace(SEEDED, n=4, max_tokens=3))
        engine.step()  # the fork parent computes the 28 tokens of the 7 full blocks, and forks
        (parent_chunk,) = fed
        assert parent_chunk[1:] == (0, 28)
        children = engine.requests["r"]
        assert [c.index for c in children] == [0, 1, 2, 3]
        shared = children[0].block_table
        assert len(shared) == 7 and all(c.block_table == shared for c in children)
        assert all(engine.block_manager.blocks[b].ref_count == 4 for b in shared)
        assert all(c.num_computed_tokens == 28 for c in children)
        outputs = engine.step()  # each choice computes the last 2 prompt tokens and samples its first token
        assert sorted(o.index for o in outputs) == [0, 1, 2, 3] and all(len(o.new_token_ids) == 1 for o in outputs)
        assert sorted(start for _, start, n in fed[1:] if n > 1) == [28] * 4
        while engine.has_unfinished_requests:
            engine.step()
    finally:
        engine.runner.run = run
    prompt_tokens_fed = sum(n for _, start, n in fed if start < len(PROMPT))
    assert prompt_tokens_fed == 28 + 4 * 2  # not 4 * 30
    assert_pool_full(llm)


def test_step_api_each_choice_finishes_on_its_own_with_one_final(llm):
    engine = llm.engine
    # Common tokens stop a choice: each stops at its own step, or reaches max_tokens.
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=7, n=6, stop_token_ids=list(range(0, 384, 5)))
    engine.add_request("r", PROMPT, params)
    tokens: dict[int, list[int]] = {i: [] for i in range(6)}
    finals = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert out.request_id == "r" and out.index not in finals
            tokens[out.index] += out.new_token_ids
            if out.finished:
                finals[out.index] = out
    assert sorted(finals) == list(range(6))
    for i, final in finals.items():
        if final.finish_reason == "stop":
            assert tokens[i][-1] % 5 == 0 and final.stop_reason == tokens[i][-1]
        else:
            assert final.finish_reason == "length" and len(tokens[i]) == 20
        assert final.num_output_tokens == len(tokens[i]) and final.num_prompt_tokens == len(PROMPT)
    assert len({len(t) for t in tokens.values()}) > 1  # they did not all end together


@pytest.mark.parametrize("steps_before_abort", [0, 1, 2, 5])  # waiting parent, forked, sampling, decoding
def test_abort_ends_every_choice_and_frees_every_block(llm, steps_before_abort):
    engine = llm.engine
    engine.add_request("r", PROMPT, dataclasses.replace(SEEDED, n=3, max_tokens=50))
    finished = set()
    for _ in range(steps_before_abort):
        finished |= {o.index for o in engine.step() if o.finished}
    finals = engine.abort("r")
    assert sorted(o.index for o in finals) == [0, 1, 2]
    assert all(o.finished and o.finish_reason == "abort" for o in finals)
    assert engine.abort("r") == [] and not finished


def test_preempted_choices_free_only_their_references_and_finish_like_unpreempted_ones(tiny_llama_dir):
    params = dataclasses.replace(SEEDED, n=4, max_tokens=40)
    expected = choice_tokens(make_llm(tiny_llama_dir).generate([PROMPT], params, use_tqdm=False)[0])
    for caching in (True, False):
        # 4 choices of 70 tokens need 4 * 18 blocks of 4 (the shared 7 once): 40 blocks force preemption.
        small = make_llm(tiny_llama_dir, num_kv_blocks=40, enable_prefix_caching=caching)
        result = small.generate([PROMPT], params, use_tqdm=False)[0]
        assert small.engine.num_preemptions > 0
        assert choice_tokens(result) == expected
        assert_pool_full(small)


def test_a_fork_parent_counts_as_its_n_choices_while_it_prefills(tiny_llama_dir):
    """The running and waiting counts (the gauges, /health, a replica's load) are choices, as max_num_seqs counts."""
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=8, max_num_seqs=4)
    llm.engine.add_request("a", list(range(5, 45)), dataclasses.replace(SEEDED, n=3, max_tokens=4))
    llm.engine.step()  # 8 of the 40 prompt tokens: the parent is still prefilling
    assert len(llm.engine.scheduler.running) == 1 and llm.engine.scheduler.running[0].num_forks == 3
    assert (llm.engine.num_running, llm.engine.num_waiting) == (3, 0)
    while "a" in llm.engine.requests:
        llm.engine.step()
    assert (llm.engine.num_running, llm.engine.num_waiting) == (0, 0)


def test_n_takes_n_places_of_max_num_seqs(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, max_num_seqs=4)
    params = dataclasses.replace(SEEDED, n=3, max_tokens=4)
    llm.engine.add_request("a", PROMPT, params)
    llm.engine.add_request("b", PROMPT, params)
    llm.engine.step()  # a's parent computes the shared blocks and forks; b's 3 choices do not fit beside a's
    assert llm.engine.num_running == 3 and llm.engine.num_waiting == 3 and llm.engine.num_seats == 6
    assert len(llm.engine.scheduler.waiting) == 1  # b's fork parent, counted as its 3 choices
    assert {s.request_id for s in llm.engine.scheduler.running} == {"a"}
    while "a" in llm.engine.requests:
        llm.engine.step()
        assert sum(s.num_seats for s in llm.engine.scheduler.running) <= 4
    while llm.engine.has_unfinished_requests:
        llm.engine.step()
    with pytest.raises(InvalidRequest, match=r"max_num_seqs \(4\)") as error:
        llm.engine.add_request("c", PROMPT, dataclasses.replace(params, n=5))
    assert error.value.param == "n"
    assert_pool_full(llm)


@pytest.mark.parametrize("kwargs", [{"n": 0}, {"n": 129}, {"n": 2.0}, {"n": True}, {"n": 2, "prompt_logprobs": 0}])
def test_bad_n_is_refused_naming_n(kwargs):
    with pytest.raises(InvalidRequest) as error:
        SamplingParams(**kwargs)
    assert error.value.param == "n"


def test_stream_yields_every_choice_until_the_last_finishes(llm):
    deltas = list(llm.stream(PROMPT, dataclasses.replace(SEEDED, n=3, max_tokens=5)))
    assert sorted(d.index for d in deltas if d.finished) == [0, 1, 2]
    assert all(sum(len(d.new_token_ids) for d in deltas if d.index == i) == 5 for i in range(3))


def test_a_fork_parent_prefilled_in_chunks_forks_once_its_last_chunk_is_computed(tiny_llama_dir, llm):
    params = dataclasses.replace(SEEDED, n=3)
    expected = choice_tokens(llm.generate([PROMPT], params, use_tqdm=False)[0])
    chunked = make_llm(tiny_llama_dir, max_num_batched_tokens=8, max_num_seqs=4, enable_prefix_caching=False)
    engine = chunked.engine
    engine.add_request("r", PROMPT, params)
    num_parent_steps = 0
    while engine.requests["r"][0].num_forks:
        assert engine.step() == []  # a fork parent samples nothing
        num_parent_steps += 1
    assert num_parent_steps == 4  # 28 shared tokens in chunks of 8
    while engine.has_unfinished_requests:
        engine.step()
    assert choice_tokens(chunked.generate([PROMPT], params, use_tqdm=False)[0]) == expected
    assert_pool_full(chunked)


@pytest.mark.parametrize("prompt", [PROMPT, [5, 6, 7]], ids=["forked", "one-block"])
def test_the_prefix_cache_counts_a_requests_prompt_once_whatever_its_n(tiny_llama_dir, prompt):
    """sluice_prefix_cache_queries_total is the prompt tokens looked up: n choices of one prompt are one lookup of
    its whole prompt, as usage's prompt_tokens counts it (a fork parent's own prompt is only the shared blocks)."""
    llm = make_llm(tiny_llama_dir)  # an empty prefix cache
    manager = llm.engine.block_manager
    llm.generate([prompt], dataclasses.replace(SEEDED, n=4, max_tokens=2), use_tqdm=False)
    assert (manager.num_prefix_queries, manager.num_prefix_hits) == (len(prompt), 0)
    llm.generate([prompt], dataclasses.replace(SEEDED, n=1, max_tokens=2), use_tqdm=False)
    assert manager.num_prefix_queries == 2 * len(prompt)
