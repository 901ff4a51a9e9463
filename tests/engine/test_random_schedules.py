"""Seeded random schedules on the native step with a pool a few blocks over one sequence's need, so that chunked
prefill, preemption, prefix-cache hits and evictions happen all the time: random arrivals of prefix-sharing prompts,
n > 1 (forks), drafts on every decode (the output alone, its last token wrong: partial acceptance and trimming),
aborts between any two steps. After every step the bookkeeping is consistent (tests/support/engine_invariants.py);
at the end every choice had one final delta, its output is the request's alone (an aborted one's a prefix of it),
and the pool is whole."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.speculative.speculator import SeqSpeculation

from tests.support.engine_invariants import assert_engine_consistent

MAX_MODEL_LEN = 32


@pytest.fixture(scope="module")
def alone(tiny_llama_dir):
    """Each request run by itself, cached by (prompt, params)."""
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=512, max_num_seqs=8, max_model_len=MAX_MODEL_LEN,
              speculative="off")
    assert llm.engine.runner.backend.name == "native"  # the batch-invariant step: batched output is output alone
    runs: dict[tuple, list[tuple[list[int], str, str]]] = {}

    def run(prompt: list[int], params: SamplingParams) -> list[tuple[list[int], str, str]]:
        key = (tuple(prompt), repr(params))
        if key not in runs:
            choices = llm.generate([prompt], params, use_tqdm=False)[0].outputs
            runs[key] = [(list(c.token_ids), c.text, str(c.finish_reason)) for c in choices]
        return runs[key]

    return run


def random_request(rng: random.Random, bases: list[list[int]], max_n: int) -> tuple[list[int], SamplingParams]:
    if rng.random() < 0.6:  # a shared prefix cut anywhere (mid-block too), and a tail of its own
        prompt = rng.choice(bases)[: rng.randint(1, 24)] + [rng.randrange(3, 380) for _ in range(rng.randint(0, 5))]
    else:
        prompt = [rng.randrange(3, 380) for _ in range(rng.randint(1, 24))]
    room = MAX_MODEL_LEN - len(prompt)
    max_tokens = rng.choice([1, 2, 6, room, None])
    sampling = rng.choice([dict(temperature=0.0), dict(temperature=1.0, seed=rng.randrange(100))])
    n = min(max_n, rng.choice([1, 1, 2, 3]))
    max_tokens = max_tokens and min(max_tokens, room)
    return prompt, SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=rng.random() < 0.8, **sampling)


def draft_the_output_alone(llm: LLM, rng: random.Random, alone, prompts: dict[str, list[int]]) -> None:
    """Drafts on every decode: the next tokens of the output alone, the last one wrong (so that some are accepted,
    one is rejected, and the blocks past the accepted ones go back)."""
    speculator = llm.engine.speculator

    def propose(seq, num_running: int) -> list[int]:
        max_drafts = min(speculator.config.num_drafts, seq.max_tokens - seq.num_output_tokens - 1,
                         speculator.max_model_len - seq.num_tokens - 1)  # fmt: skip
        if max_drafts <= 0 or seq.num_forks:
            return []
        if seq.speculation is None:
            seq.speculation = SeqSpeculation(speculator.config, speculator.prior_acceptance)
            seq.speculation.proposer = "prompt"
        expected = alone(prompts[seq.request_id], seq.request.params)[seq.index][0]
        drafts = expected[seq.num_output_tokens : seq.num_output_tokens + rng.randint(1, max_drafts)]
        return drafts[:-1] + [(drafts[-1] + 1) % 380] if drafts else []

    speculator.propose = propose


@pytest.mark.parametrize("seed, num_kv_blocks, max_num_seqs, max_num_batched_tokens", [
    (0, 8, 4, 8), (1, 10, 8, 16), (2, 9, 2, 5), (3, 12, 8, 64),
])  # fmt: skip
def test_random_schedules_keep_the_books_and_give_each_request_its_output_alone(
    tiny_llama_dir, alone, seed: int, num_kv_blocks: int, max_num_seqs: int, max_num_batched_tokens: int
) -> None:
    rng = random.Random(seed)
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens, max_model_len=MAX_MODEL_LEN, speculative="on",
              speculative_k=4)  # fmt: skip
    engine = llm.engine
    bases = [[rng.randrange(3, 380) for _ in range(24)] for _ in range(2)]
    prompts: dict[str, list[int]] = {}
    params: dict[str, SamplingParams] = {}
    deltas: dict[tuple[str, int], list] = {}
    draft_the_output_alone(llm, rng, alone, prompts)
    finished = []

    def take(outputs) -> None:
        for out in outputs:
            deltas.setdefault((out.request_id, out.index), []).append(out)

    def live_seqs() -> dict[int, object]:
        return {id(seq): seq for seqs in engine.requests.values() for seq in seqs}

    num_steps = 0
    while len(prompts) < 24 or engine.has_unfinished_requests:
        while len(prompts) < 24 and rng.random() < 0.4:
            request_id = f"r{len(prompts)}"
            prompts[request_id], params[request_id] = random_request(rng, bases, max_num_seqs)
            engine.add_request(request_id, prompts[request_id], params[request_id])
        if engine.requests and rng.random() < 0.1:  # waiting, prefilling, preempted, a fork parent, decoding
            before = live_seqs()
            take(engine.abort(rng.choice(list(engine.requests))))
            finished += [seq for key, seq in before.items() if key not in live_seqs()]
            assert_engine_consistent(engine, finished)
        before = live_seqs()
        take(engine.step())
        finished += [seq for key, seq in before.items() if key not in live_seqs()]
        assert_engine_consistent(engine, finished)
        num_steps += 1
        assert num_steps < 2000
    assert engine.num_free_blocks == engine.num_total_blocks
    assert engine.num_preemptions > 0 and engine.speculation_stats.by_proposer["prompt"].num_accepted_tokens > 0

    for request_id, prompt in prompts.items():
        for index, (tokens, text, reason) in enumerate(alone(prompt, params[request_id])):
            choice = deltas[(request_id, index)]
            assert [d.finished for d in choice] == [False] * (len(choice) - 1) + [True]  # one final, the last
            got = [t for d in choice for t in d.new_token_ids], "".join(d.text_delta for d in choice)
            if choice[-1].finish_reason == "abort":
                assert got[0] == tokens[: len(got[0])] and text.startswith(got[1]), (request_id, index)
            else:
                assert (*got, choice[-1].finish_reason) == (tokens, text, reason), (request_id, index)
