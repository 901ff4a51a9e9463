"""The sampler is total: every parameter value SamplingParams accepts, alone and in combination and at the
float edges (denormals, values that vanish or overflow in float32 and bf16), yields a token for every row in
bounded time, on ordinary and on degenerate logits. Values it cannot honour are refused up front."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.batch import SamplingRow
from engine.errors import InvalidRequest
from engine.sampler import Sampler
from engine.sampling_params import MAX_LOGPROBS, MAX_TEMPERATURE, SamplingParams

VOCAB = 300
# Each example is a handful of rows over a small vocabulary: seconds would mean a loop that did not end.
TOTAL = settings(max_examples=300, deadline=timedelta(seconds=5), suppress_health_check=[HealthCheck.too_slow])

@pytest.fixture(autouse=True)
def fail_instead_of_hanging() -> Iterator[None]:
    """A sampler loop that never ends fails the test (the alarm interrupts the Python loop) instead of CI."""

    def timed_out(signum: int, frame: object) -> None:
        raise TimeoutError("the sampler did not return: it is not total")

    previous = signal.signal(signal.SIGALRM, timed_out)
    signal.alarm(120)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


EDGE_FLOATS = [0.0, 5e-324, 1e-310, 1e-45, 1e-40, 1.2e-38, 1e-30, 1e-7, 1e-5, 0.5, 1.0, 2.0, 3.4e38, 1e39, 1e300]


def floats_in(low: float, high: float, exclude_low: bool = False) -> st.SearchStrategy[float]:
    edges = [x for x in EDGE_FLOATS if (low < x if exclude_low else low <= x) and x <= high]
    finite = st.floats(low, high, exclude_min=exclude_low, allow_nan=False, allow_infinity=False)
    return st.one_of(st.sampled_from(edges), finite) if edges else finite


sampling_params = st.builds(
    SamplingParams,
    temperature=floats_in(0.0, MAX_TEMPERATURE),
    top_k=st.one_of(st.sampled_from([-1, 0, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1, 2**62]), st.integers(-1, 10**6)),
    top_p=floats_in(0.0, 1.0, exclude_low=True),
    min_p=floats_in(0.0, 1.0),
    presence_penalty=floats_in(-2.0, 2.0),
    frequency_penalty=floats_in(-2.0, 2.0),
    repetition_penalty=floats_in(0.0, 1e300, exclude_low=True),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, -1, 2**63 - 1, -(2**63)])),
    logprobs=st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
    logit_bias=st.one_of(
        st.none(),
        st.dictionaries(
            st.integers(0, VOCAB + 5), floats_in(-100.0, 100.0) | floats_in(0.0, 100.0).map(lambda x: -x), max_size=8
        ),
    ),
)

logit_rows = st.one_of(
    st.just("normal"),
    st.just("huge"),  # near float32's largest: a tiny temperature makes the division overflow
    st.just("spiky"),
    st.just("all_equal"),
    st.just("with_neg_inf"),
    st.just("with_nan"),  # a broken model: NaN is never chosen unless nothing else is left
    st.just("all_neg_inf"),
)


def make_logits(kind: str, generator: torch.Generator) -> torch.Tensor:
    row = torch.randn(VOCAB, generator=generator) * 4
    if kind == "huge":
        row = row.sign() * 3.0e38
    elif kind == "spiky":
        row[7] = 1e4
    elif kind == "all_equal":
        row = torch.zeros(VOCAB)
    elif kind == "with_neg_inf":
        row[::3] = float("-inf")
    elif kind == "with_nan":
        row[::5] = float("nan")
    elif kind == "all_neg_inf":
        row = torch.full((VOCAB,), float("-inf"))
    return row


def row_for(params: SamplingParams, output_token_ids: list[int], banned: tuple[int, ...]) -> SamplingRow:
    """The row LLMEngine builds for a sequence with these parameters."""
    return SamplingRow(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        seed=params.seed,
        num_logprobs=params.logprobs,
        num_output_tokens=len(output_token_ids),
        prompt_token_ids=[1, 2, 3, 250, 299],
        output_token_ids=output_token_ids,
        banned_token_ids=banned,
        logit_bias=params.logit_bias,
    )


@TOTAL
@given(
    rows=st.lists(
        st.tuples(
            sampling_params,
            logit_rows,
            st.lists(st.integers(0, VOCAB - 1), max_size=20),
            st.lists(st.integers(0, VOCAB + 5), max_size=5).map(tuple),
        ),
        min_size=1,
        max_size=6,
    ),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_accepted_parameter_set_yields_a_token_per_row(rows, dtype, seed) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.stack([make_logits(kind, generator) for _, kind, _, _ in rows]).to(dtype)
    sampling_rows = [row_for(params, outputs, banned) for params, _, outputs, banned in rows]
    tokens = Sampler(vocab_size=VOCAB, seed=seed)(logits, sampling_rows)
    assert len(tokens) == len(rows)
    for token, (params, kind, _, banned) in zip(tokens, rows):
        assert 0 <= token.token_id < VOCAB
        if kind not in ("with_nan", "all_neg_inf"):  # rows with tokens to choose from: bans hold
            assert token.token_id not in banned
        if params.logprobs is not None:
            assert token.logprob is not None and len(token.top_logprobs or []) == params.logprobs


@TOTAL
@given(
    temperature=floats_in(0.0, MAX_TEMPERATURE),
    top_p=floats_in(0.0, 1.0, exclude_low=True),
    repetition_penalty=floats_in(0.0, 1e300, exclude_low=True),
)
def test_a_single_row_is_sampled_alone_and_in_a_batch_with_the_same_seed(temperature, top_p, repetition_penalty):
    params = SamplingParams(temperature=temperature, top_p=top_p, repetition_penalty=repetition_penalty, seed=42)
    logits = make_logits("normal", torch.Generator().manual_seed(0)).unsqueeze(0)
    alone = Sampler(vocab_size=VOCAB)(logits, [row_for(params, [5, 6], ())])[0].token_id
    other = SamplingParams(temperature=1.0, top_p=0.3)
    batch_logits = torch.cat([logits, make_logits("spiky", torch.Generator().manual_seed(1)).unsqueeze(0)])
    batched = Sampler(vocab_size=VOCAB)(batch_logits, [row_for(params, [5, 6], ()), row_for(other, [], ())])
    assert batched[0].token_id == alone  # seeded rows do not depend on the batch


@given(
    name=st.sampled_from(["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                          "repetition_penalty"]),
    value=st.sampled_from([float("inf"), float("-inf"), float("nan")]),
)  # fmt: skip
def test_non_finite_values_are_refused_naming_the_parameter(name, value) -> None:
    try:
        SamplingParams(**{name: value})
    except InvalidRequest as error:
        assert error.param == name
    else:
        raise AssertionError(f"{name}={value} was accepted")


@TOTAL
@given(
    kind=st.sampled_from(["normal", "spiky", "all_equal", "with_neg_inf"]),
    forced=st.integers(0, VOCAB - 1),
    other_biases=st.dictionaries(st.integers(0, VOCAB - 1), floats_in(-100.0, 0.0), max_size=8),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**32 - 1),
)
def test_logit_bias_forces_and_bans_on_greedy_rows(kind, forced, other_biases, dtype, seed) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = make_logits(kind, generator).unsqueeze(0).to(dtype)
    finite = logits.float().isfinite()[0]
    best = int(logits.float().argmax())
    # +100 on one finite token makes it the argmax of logits spread by less than 100 (randn * 4; spiky's 1e4 aside).
    if finite[forced] and kind != "spiky":
        bias = {**other_biases, forced: 100.0}
        token = Sampler(vocab_size=VOCAB)(logits, [row_for(SamplingParams(temperature=0, logit_bias=bias), [], ())])
        assert token[0].token_id == forced
    # -100 on the argmax, and nothing else: any token but it wins (all_equal: every other token ties above it).
    if kind != "spiky":
        banned = SamplingParams(temperature=0, logit_bias={best: -100.0})
        assert Sampler(vocab_size=VOCAB)(logits, [row_for(banned, [], ())])[0].token_id != best


@given(
    bias=st.sampled_from([{1: float("inf")}, {1: float("nan")}, {1: 100.5}, {1: True}, {-1: 1.0}, {"1.5": 1.0},
                          {1: "5"}, {i: 1.0 for i in range(301)}, [1, 2]]),
)  # fmt: skip
def test_bad_logit_bias_is_refused_naming_it(bias) -> None:
    try:
        SamplingParams(logit_bias=bias)
    except InvalidRequest as error:
        assert error.param == "logit_bias"
    else:
        raise AssertionError(f"logit_bias={bias!r} was accepted")


def test_logit_bias_keys_may_be_json_strings() -> None:
    assert SamplingParams(logit_bias={"50": -100, 7: 2.5}).logit_bias == {50: -100.0, 7: 2.5}
    assert SamplingParams(logit_bias={}).logit_bias is None
