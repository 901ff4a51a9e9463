"""Speculative decoding without a draft model (engine/speculative/): the proposers, and the promises: greedy and
seeded output the same with speculation on as off (alone, batched, with logprobs, stops, min_tokens, logit_bias,
grammars, preemption), unseeded sampling with the same distribution, one delta per step, no block lost."""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest

from engine import SamplingParams
from engine.speculative.prompt_lookup import NgramIndex
from engine.speculative.suffix_index import RecentOutputs
from engine.structured_outputs import StructuredOutputs

from tests.support.engine_helpers import assert_pool_full, make_llm

PROMPTS = [
    "def add(a, b):\n    return a + b\n" * 3,
    "hello world hello world hello",
    "abc abc abc abc abc",
    "The quick brown fox jumps over the lazy dog. The quick brown",
]


class Tokens:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


def test_prompt_lookup_proposes_what_followed_the_latest_earlier_match():
    index = NgramIndex(2, 3)
    seq = Tokens([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3])
    # the suffix (2, 3) occurred twice before; the latest (followed by 5, 6, 7) wins; (7, 2, 3) never did
    assert index.propose(seq, len(seq.tokens), 3) == [5, 6, 7]
    assert index.propose(seq, len(seq.tokens), 1) == [5]
    seq.tokens += [8, 8]  # (3, 8, 8), (8, 8) never seen before
    assert index.propose(seq, len(seq.tokens), 3) == []
    seq.tokens += [1, 2, 3, 4]  # (2, 3, 4) occurred at the start, before 9
    assert index.propose(seq, len(seq.tokens), 2) == [9, 2]
    assert NgramIndex(2, 3).propose(Tokens([5, 6]), 2, 4) == []


def test_recent_outputs_propose_across_requests_and_stay_bounded():
    recent = RecentOutputs(2, 3, max_tokens=12)
    recent.add([10, 11, 12, 13, 14, 15])
    assert recent.propose([99, 11, 12], 3) == [13, 14, 15]
    assert recent.propose([1, 2], 3) == []
    recent.add([20, 21, 22, 23, 24, 25, 26])  # 13 tokens in all: the first output is evicted
    assert recent.num_tokens == 7
    assert recent.propose([11, 12], 3) == []
    assert recent.propose([21, 22], 2) == [23, 24]
    recent.add(list(range(100)))  # longer than the whole bound: ignored
    assert recent.num_tokens == 7


def _run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def llms(tiny_llama_dir):
    """(off, on): the same tiny model without and with speculation ("on": whenever a proposer has drafts)."""
    return make_llm(tiny_llama_dir, speculative="off"), make_llm(tiny_llama_dir, speculative="on")


@pytest.fixture(autouse=True)
def both_pools_return_to_full(request):
    yield
    if "llms" in request.fixturenames:
        for llm in request.getfixturevalue("llms"):
            assert_pool_full(llm)


def _accepted(llm) -> int:
    return sum(c.num_accepted_tokens for c in llm.engine.speculation_stats.by_proposer.values())


@pytest.mark.parametrize("batched", [False, True])
def test_greedy_output_is_the_same_with_speculation_on(llms, batched):
    off, on = llms
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    before = _accepted(on)
    if batched:
        expected, got = _run(off, PROMPTS, params), _run(on, PROMPTS, params)
    else:
        expected = [_run(off, [p], params)[0] for p in PROMPTS]
        got = [_run(on, [p], params)[0] for p in PROMPTS]
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.text for o in got] == [o.text for o in expected]
    assert _accepted(on) > before  # drafts were verified and accepted, not only proposed


def test_logprobs_stops_min_tokens_and_logit_bias_stay_exact(llms):
    off, on = llms
    reference = _run(off, PROMPTS[:1], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    stop_text = reference.text[20:24]
    cases = [
        SamplingParams(max_tokens=40, temperature=0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, stop=[stop_text]),
        SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[reference.token_ids[15]], min_tokens=20),
        SamplingParams(max_tokens=40, temperature=0, logit_bias={reference.token_ids[10]: -100}, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=0, ignore_eos=True),
    ]
    for params in cases:
        want = _run(off, PROMPTS, params)
        got = _run(on, PROMPTS, params)
        for w, g in zip(want, got):
            assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
                w.token_ids, w.text, w.finish_reason, w.stop_reason
            ), params  # fmt: skip
            if params.logprobs is not None:  # a verified row is computed as a prefill row: equal to rounding
                assert len(g.logprobs) == len(w.logprobs)
                for a, b in zip(g.logprobs, w.logprobs):
                    assert a.token_id == b.token_id and [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
                    values = [(a.logprob, b.logprob)]
                    values += [(x, y) for (_, x), (_, y) in zip(a.top_logprobs, b.top_logprobs)]
                    assert all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4) for x, y in values)


def test_a_grammar_rejects_the_drafts_it_forbids(llms):
    off, on = llms
    pattern = r"(ab|cd){3,12}"
    params = SamplingParams(max_tokens=30, temperature=0, structured_outputs=StructuredOutputs(regex=pattern))
    prompts = ["ab ab ab xy xy xy ab cd", "abcdabcdabcd", "cd cd cd"]
    want, got = _run(off, prompts, params), _run(on, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for out in got:
        assert re.fullmatch(pattern, out.text) or out.finish_reason == "length", out.text


def test_seeded_sampling_returns_the_same_tokens_with_speculation_on(llms):
    off, on = llms
    params = [SamplingParams(max_tokens=40, temperature=0.7, top_k=8, top_p=0.9, seed=s, ignore_eos=True)
              for s in range(len(PROMPTS))]  # fmt: skip
    want = _run(off, PROMPTS, params)
    got = _run(on, PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.token_ids for o in _run(on, PROMPTS, params)] == [o.token_ids for o in want]  # reproducible


def test_unseeded_sampling_keeps_its_distribution(llms):
    """Triples of output tokens of many unseeded samples, with speculation on and off: the second is verified
    against a draft, the third sampled after it. A chi-square test of the two samples (fixed generator seeds, so
    the test is deterministic) must not reject at p = 0.001; with speculation on, drafts must be rejected
    and accepted many times (else the test would show nothing)."""
    off, on = llms
    # The tiny model's greedy output for this prompt loops (285, 1, 285, 1, ...): its first tokens, appended to
    # the prompt, put it where prompt lookup proposes tokens the model itself finds likely.
    greedy = _run(off, [PROMPTS[2]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    prompt = off.engine.tokenizer.encode(PROMPTS[2]) + greedy.token_ids
    # the first token comes from the prefill; the second is verified against a draft, the third sampled after it
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=2, ignore_eos=True)
    counts = []
    for llm in (off, on):
        llm.engine.runner.sampler._generator.manual_seed(1234)
        stats = llm.engine.speculation_stats.by_proposer["prompt"]
        drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
        outs = _run(llm, [prompt] * 400, params)
        counts.append(Counter(tuple(o.token_ids) for o in outs))
    num_drafted, num_accepted = stats.num_draft_tokens - drafted, stats.num_accepted_tokens - accepted
    assert num_drafted >= 200 and 50 <= num_accepted <= num_drafted - 50, (num_drafted, num_accepted)
    categories = sorted(set(counts[0]) | set(counts[1]))
    chi2 = sum((counts[0][c] - counts[1][c]) ** 2 / (counts[0][c] + counts[1][c]) for c in categories)
    dof = len(categories) - 1
    # chi-square survival at p = 0.001 (Wilson-Hilferty): reject above it
    z = 3.090
    threshold = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < threshold, (chi2, threshold, counts)


def test_each_step_gives_a_choice_one_delta_with_all_its_accepted_tokens(llms):
    _, on = llms
    engine = on.engine
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, n=2, seed=3)
    engine.add_request("burst", PROMPTS[0], params)
    sizes = []
    while engine.has_unfinished_requests:
        outputs = engine.step()
        assert len({o.index for o in outputs}) == len(outputs)  # one delta per choice per step
        sizes += [len(o.new_token_ids) for o in outputs]
    assert max(sizes) > 1 and sum(sizes) == 80


def test_preemption_and_aborts_mid_speculation_lose_nothing(tiny_llama_dir, llms):
    off, _ = llms
    tight = make_llm(tiny_llama_dir, speculative="on", num_kv_blocks=48, block_size=4, max_num_seqs=8)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = _run(off, PROMPTS * 2, params)
    got = _run(tight, PROMPTS * 2, params)
    assert tight.engine.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert_pool_full(tight)

    engine = tight.engine
    for i, prompt in enumerate(PROMPTS * 2):
        engine.add_request(f"a{i}", prompt, params)
    num_aborted = 0
    while engine.has_unfinished_requests:
        plan = engine.schedule_step()
        if plan is None:
            break
        has_drafts = any(c.draft_token_ids for c in plan.chunks)
        engine.finish_step(plan, engine.execute(plan))
        if has_drafts:  # the abort arrived while a speculative step ran: applied after it
            victim = next(iter(engine.requests))
            assert engine.abort(victim)[0].finish_reason == "abort"
            num_aborted += 1
    assert num_aborted > 0
    assert_pool_full(tight)


def test_a_request_can_opt_out_and_bad_settings_are_refused(llms, tiny_llama_dir):
    _, on = llms
    stats = on.engine.speculation_stats.by_proposer["prompt"]
    before = stats.num_steps
    _run(on, PROMPTS[:1], SamplingParams(max_tokens=30, temperature=0, speculative=False))
    assert stats.num_steps == before
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="no")
    with pytest.raises(ValueError, match="speculative"):
        make_llm(tiny_llama_dir, speculative="sometimes")
    with pytest.raises(ValueError, match="speculative_k"):
        make_llm(tiny_llama_dir, speculative_k=0)


class _Seq(Tokens):
    """The little of a Sequence the speculator reads."""

    def __init__(self, tokens: list[int]) -> None:
        super().__init__(tokens)
        self.params = SamplingParams(max_tokens=100)
        self.num_forks = 0
        self.max_tokens = 100
        self.num_output_tokens = 0
        self.num_tokens = len(tokens)
        self.matcher = None
        self.speculation = None


def test_auto_drafts_only_where_rows_are_cheap_for_the_step_and_acceptance():
    from engine.speculative.speculator import PROBE_INTERVAL, SpeculativeConfig, Speculator
    from engine.speculative.step_cost import StepCostModel

    model = StepCostModel()
    for rows in (1, 6, 1, 6, 2):
        model.observe(rows, 0.010 + 0.001 * rows)  # memory-bound: 10 ms a step, 1 ms a row
    assert math.isclose(model.fixed, 0.010) and math.isclose(model.per_row, 0.001)
    assert math.isclose(model.break_even(1, 1), 0.001 / 0.011)
    assert model.break_even(32, 32) > 0.7  # at 32 rows a row must pay nearly a whole token

    tokens = [1, 2, 3, 4, 5, 6, 7, 8] * 4
    cheap = Speculator(SpeculativeConfig(mode="auto", num_drafts=5), 4096)
    for rows in (1, 6, 1, 6):
        cheap.on_step(rows, 0.010 + 0.001 * rows)
    seq = _Seq(tokens)
    # 1 running, rows nearly free: the j-th draft is worth 0.5 ** j (the prior) against a row's 0.09 * 1.15
    assert cheap.propose(seq, 1) == [1, 2, 3]
    cheap.on_verified(seq, 3, 3)
    cheap.on_verified(seq, 3, 3)  # all accepted twice: its acceptance is now 0.755, and 0.755 ** 5 pays
    assert cheap.propose(seq, 1) == [1, 2, 3, 4, 5]
    assert cheap.propose(_Seq(tokens), 32) == []  # 32 running: a row costs nearly a token

    costly = Speculator(SpeculativeConfig(mode="auto"), 4096)
    for rows in (1, 6, 1, 6):
        costly.on_step(rows, 0.004 + 0.006 * rows)  # a row must yield 0.6 tokens: the prior 0.5 does not
    seq = _Seq(tokens)
    proposals = [costly.propose(seq, 1) for _ in range(PROBE_INTERVAL + 1)]
    assert proposals[:PROBE_INTERVAL] == [[]] * PROBE_INTERVAL and proposals[-1] == [1]  # a probe, now and then

    hopeless = Speculator(SpeculativeConfig(mode="auto"), 4096)
    for rows in (1, 6, 1, 6):
        hopeless.on_step(rows, 0.010 * rows)  # every row costs as much as a step: no draft ever pays
    seq = _Seq(tokens)
    assert all(hopeless.propose(seq, 1) == [] for _ in range(2 * PROBE_INTERVAL))  # not even probes


def test_a_step_timed_across_a_pause_leaves_the_step_cost_alone_until_the_machine_really_changed():
    """A process stopped mid-step (SIGSTOP, a VM pause) times that step in minutes: fed to the fit, a(t) and b fell to
    0 (draft everything) or rose (no drafts) for hundreds of steps. A step far above the fit's own prediction is left
    out, unless the steps after it are too: then the machine changed, and the fit follows."""
    from engine.speculative.step_cost import MAX_SKIPPED, StepCostModel

    model = StepCostModel()
    for i in range(300):
        rows = 1 + i % 6
        model.observe(rows, 0.010 + 0.001 * rows)
    model.observe(4, 120.0)  # paused
    model.observe(1, 0.011)
    assert math.isclose(model.fixed, 0.010, rel_tol=1e-3) and math.isclose(model.per_row, 0.001, rel_tol=1e-3)
    for i in range(MAX_SKIPPED + 300):  # 20x slower from now on: a machine that changed
        rows = 1 + i % 6
        model.observe(rows, 20 * (0.010 + 0.001 * rows))
    assert math.isclose(model.fixed, 0.200, rel_tol=0.05) and math.isclose(model.per_row, 0.020, rel_tol=0.05)


def test_an_auto_engine_learns_its_step_cost_and_keeps_the_output(tiny_llama_dir, llms):
    off, _ = llms
    auto = make_llm(tiny_llama_dir, speculative="auto")
    cost = auto.engine.speculator.cost
    # probed at load: the seconds of real steps, no longer the pessimistic 1 s a step and a row (a tiny model's
    # extra rows can cost nothing measurable: per_row may be 0, so break-even too)
    assert 0 <= cost.fixed < 1 and 0 <= cost.per_row < 1 and 0 <= cost.break_even(1, 1) <= 1
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in _run(auto, PROMPTS, params)] == [o.token_ids for o in _run(off, PROMPTS, params)]
    assert_pool_full(auto)


@pytest.mark.parametrize("block_size, num_kv_blocks, k", [(1, 64, 8), (2, 64, 8), (4, 2, 16), (16, 1, 16)])
def test_an_auto_engine_starts_on_small_blocks_and_small_pools(tiny_llama_dir, llms, block_size, num_kv_blocks, k):
    """The load-time probe's 1 + k rows need k + 1 slots: blocks of 1 or 2 tokens, or a pool of a block or two,
    hold fewer in the 4 blocks it used (an IndexError at load)."""
    off, _ = llms
    auto = make_llm(tiny_llama_dir, speculative="auto", speculative_k=k, block_size=block_size,
                    num_kv_blocks=num_kv_blocks)  # fmt: skip
    assert 0 <= auto.engine.speculator.cost.fixed < 1
    prompt = [5, 6, 7, 5, 6, 7]
    params = SamplingParams(max_tokens=auto.engine.max_model_len - len(prompt), temperature=0, ignore_eos=True)
    assert _run(auto, [prompt], params)[0].token_ids == _run(off, [prompt], params)[0].token_ids
    assert_pool_full(auto)
