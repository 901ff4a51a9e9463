"""logit_bias through the engine: -100 bans a token, +100 forces it, ids are checked against the vocabulary,
and logprobs stay those of the model's own distribution."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.errors import InvalidRequest

PROMPT = "The quick brown fox"


def generate(llm, **kwargs):
    params = SamplingParams(max_tokens=12, ignore_eos=True, **kwargs)
    return llm.generate([PROMPT], params, use_tqdm=False)[0]


def test_minus_100_bans_the_tokens_greedy_would_choose(llm):
    plain = generate(llm, temperature=0).token_ids
    banned = set(plain)
    biased = generate(llm, temperature=0, logit_bias={t: -100 for t in banned}).token_ids
    assert len(biased) == 12 and not banned & set(biased)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plus_100_forces_a_token(llm, temperature):
    assert generate(llm, temperature=temperature, seed=3, logit_bias={42: 100}).token_ids == [42] * 12


def test_string_keys_and_mixed_requests_in_one_batch(llm):
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias=b) for b in ({"42": 100}, None)]
    forced, plain = llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
    assert forced.token_ids == [42] * 6
    assert plain.token_ids == generate(llm, temperature=0).token_ids[:6]  # an unbiased row is left alone


def test_logprobs_are_the_models_not_the_biased_ones(llm):
    top = generate(llm, temperature=0, logprobs=20).logprobs[0].top_logprobs
    token_id, model_logprob = top[5]
    forced = generate(llm, temperature=0, logprobs=0, logit_bias={token_id: 100}).logprobs[0]
    assert forced.token_id == token_id and forced.logprob == pytest.approx(model_logprob, abs=1e-4)


def test_ids_outside_the_vocabulary_are_refused_before_anything_runs(llm):
    engine = llm.engine
    with pytest.raises(InvalidRequest, match="outside the vocabulary") as error:
        engine.add_request("bad", PROMPT, SamplingParams(logit_bias={engine.vocab_size: 1.0}))
    assert error.value.param == "logit_bias" and not engine.has_unfinished_requests
