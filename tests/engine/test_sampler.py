from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine import sampler as sampler_module
from engine.batch import SamplingRow
from engine.native import available_isas, native_ops, use_isa
from engine.sampler import Sampler, apply_bans_, apply_penalties_, argmax_rows, row_seed, topk_rows


@pytest.fixture(params=["native", "torch"])
def sampling_path(request, monkeypatch) -> str:
    """Rows without top-k or min-p sample in the native extension when it is built; "torch" turns that off."""
    if request.param == "native" and native_ops() is None:
        pytest.skip("the native step is not built (make install builds it)")
    if request.param == "torch":
        monkeypatch.setattr(sampler_module, "_native_ops", lambda: None)
    return request.param


def make_row(**overrides: object) -> SamplingRow:
    fields: dict[str, object] = dict(
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        seed=None,
        num_logprobs=None,
        num_output_tokens=0,
        prompt_token_ids=[],
        output_token_ids=[],
    )
    fields.update(overrides)
    return SamplingRow(**fields)  # type: ignore[arg-type]


def draw(probs: list[float], n: int, seed: int = 0, **overrides: object) -> Counter[int]:
    """Token counts of n independent draws (one row each) from logits log(probs)."""
    logits = torch.tensor(probs).log().expand(n, -1).contiguous()
    tokens = Sampler(seed=seed)(logits, [make_row(**overrides) for _ in range(n)])
    return Counter(t.token_id for t in tokens)


def chi_square(counts: Counter[int], expected: torch.Tensor) -> float:
    n = sum(counts.values())
    return sum((counts.get(i, 0) - n * p) ** 2 / (n * p) for i, p in enumerate(expected.tolist()) if p > 0)


@pytest.mark.parametrize("n", [1, 64])
def test_greedy_is_argmax(n: int) -> None:
    logits = torch.randn(n, 500, generator=torch.Generator().manual_seed(n))
    rows = [make_row(temperature=0.0) if i % 2 else make_row(top_k=1, temperature=0.7) for i in range(n)]
    tokens = Sampler(seed=1)(logits, rows)
    assert [t.token_id for t in tokens] == logits.argmax(dim=-1).tolist()
    assert all(type(t.token_id) is int and t.logprob is None and t.top_logprobs is None for t in tokens)


def test_mixed_greedy_and_sampled_rows_keep_their_positions() -> None:
    logits = torch.full((6, 50), -20.0)
    for i in range(6):
        logits[i, 7 * i] = 10.0  # each row has one overwhelmingly likely token
    rows = [make_row(temperature=0.0 if i % 3 == 0 else 1.0, top_p=0.9 if i == 4 else 1.0) for i in range(6)]
    assert [t.token_id for t in Sampler(seed=0)(logits, rows)] == [0, 7, 14, 21, 28, 35]


def test_temperature_sampling_matches_softmax(sampling_path: str) -> None:
    probs = [0.4, 0.2, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01]
    n = 20000
    counts = draw(probs, n, seed=3)
    # 7 degrees of freedom: P(chi2 > 24.3) = 0.001
    assert chi_square(counts, torch.tensor(probs)) < 24.3

    hot = draw(probs, n, seed=4, temperature=2.0)
    expected = torch.softmax(torch.tensor(probs).log() / 2.0, dim=0)
    assert chi_square(hot, expected) < 24.3
    assert chi_square(hot, torch.tensor(probs)) > 100  # temperature really flattened the distribution


def test_top_k_keeps_only_the_k_most_likely() -> None:
    probs = [0.05, 0.3, 0.05, 0.25, 0.05, 0.2, 0.05, 0.05]
    counts = draw(probs, 6000, top_k=3)
    assert set(counts) == {1, 3, 5}
    expected = torch.tensor([0, 0.3, 0, 0.25, 0, 0.2, 0, 0]) / 0.75
    assert chi_square(counts, expected) < 13.8  # 2 degrees of freedom, p = 0.001


def test_top_k_larger_than_vocab_is_off() -> None:
    counts = draw([0.25] * 4, 2000, top_k=100)
    assert set(counts) == {0, 1, 2, 3}


def test_top_p_keeps_the_smallest_nucleus(sampling_path: str) -> None:
    probs = [0.1, 0.5, 0.05, 0.3, 0.05]
    assert set(draw(probs, 4000, top_p=0.75)) == {1, 3}  # 0.5 + 0.3 is the smallest set reaching 0.75
    assert set(draw(probs, 4000, top_p=0.85)) == {0, 1, 3}
    assert set(draw(probs, 500, top_p=0.01)) == {1}  # the top token is always kept


def test_top_p_rejection_keeps_the_renormalised_distribution(sampling_path: str) -> None:
    probs = [0.05, 0.3, 0.08, 0.2, 0.1, 0.15, 0.12]
    counts = draw(probs, 9000, seed=6, top_p=0.6)  # 0.3 + 0.2 + 0.15 = 0.65: every draw needs the exact test
    assert set(counts) == {1, 3, 5}
    assert chi_square(counts, torch.tensor([0, 0.3, 0, 0.2, 0, 0.15, 0]) / 0.65) < 13.8


def test_top_p_applies_to_the_top_k_distribution() -> None:
    probs = [0.3, 0.25, 0.2, 0.15, 0.1]
    # After top_k=3 the masses are .4, .333, .267: top_p=0.7 needs two tokens (three without renormalising).
    counts = draw(probs, 6000, seed=7, top_k=3, top_p=0.7)
    assert set(counts) == {0, 1}
    assert chi_square(counts, torch.tensor([0.3, 0.25, 0, 0, 0]) / 0.55) < 10.8  # 1 degree of freedom


def nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """Reference: sort, keep the shortest prefix whose mass reaches top_p (plus ties with its last token)."""
    ordered = probs.sort(descending=True).values
    floor = ordered[int((ordered.cumsum(0) < top_p).sum().clamp(max=len(ordered) - 1))]
    return set(torch.nonzero(probs >= floor).flatten().tolist())


@pytest.mark.parametrize("scale", [8.0, 2.0, 0.5, 0.05])
def test_top_p_matches_a_sort_reference(scale: float, sampling_path: str) -> None:
    gen = torch.Generator().manual_seed(5)
    vocab = 20000
    logits = torch.randn(vocab, generator=gen) * scale
    top_p = 0.8
    allowed = nucleus(torch.softmax(logits, dim=0), top_p)
    out = Sampler(seed=1)(logits.expand(500, -1).contiguous(), [make_row(top_p=top_p)] * 500)
    tokens = Counter(t.token_id for t in out)
    assert set(tokens) <= allowed
    if len(allowed) > 100:  # a wide nucleus is explored, not collapsed onto its head
        assert len(tokens) > min(250, len(allowed) // 4)


def test_top_p_sampling_never_leaves_a_wide_nucleus(sampling_path: str) -> None:
    vocab = 4000
    logits = torch.linspace(1.0, -1.0, vocab).expand(300, -1).contiguous()
    rows = [make_row(top_p=0.6) for _ in range(300)]
    tokens = [t.token_id for t in Sampler(seed=9)(logits, rows)]
    probs = torch.softmax(logits[0], dim=0)
    size = int((probs.cumsum(0) < 0.6).sum()) + 1  # logits are sorted: the nucleus is a prefix
    assert size > 1024
    assert max(tokens) < size
    assert len(set(tokens)) > 200


def test_min_p_drops_tokens_below_the_scaled_floor() -> None:
    probs = [0.04, 0.5, 0.06, 0.3, 0.1]
    counts = draw(probs, 6000, min_p=0.15)  # floor 0.075: tokens 0 and 2 are out
    assert set(counts) == {1, 3, 4}
    assert chi_square(counts, torch.tensor([0, 0.5, 0, 0.3, 0.1]) / 0.9) < 13.8


def test_filters_combine() -> None:
    probs = [0.3, 0.25, 0.2, 0.15, 0.1]
    # top_k=4 -> [.3,.25,.2,.15]/.9; top_p=0.7 -> first three (0.333+0.278 < 0.7); min_p=0.7 -> 0.2/0.3 < 0.7
    assert set(draw(probs, 3000, top_k=4, top_p=0.7, min_p=0.7)) == {0, 1}


def test_seeded_rows_ignore_batch_composition(sampling_path: str) -> None:
    gen = torch.Generator().manual_seed(11)
    vocab = 3000
    target = torch.randn(vocab, generator=gen)
    others = torch.randn(5, vocab, generator=gen)
    other_rows = [
        make_row(temperature=0.0),
        make_row(top_p=0.9),
        make_row(top_k=20, temperature=0.5, seed=99),
        make_row(frequency_penalty=1.0, output_token_ids=[1, 2, 3]),
        make_row(min_p=0.1, num_logprobs=2),
    ]

    def run(step: int, position: int, batch: int, sampler_seed: int, **params: object) -> int:
        rows = other_rows[:batch]
        row = make_row(seed=1234, num_output_tokens=step, output_token_ids=list(range(step)), **params)
        logits = torch.cat([others[:batch], target.unsqueeze(0)])
        order = list(range(batch))
        order.insert(position, batch)
        out = Sampler(seed=sampler_seed)(logits[order], [rows[i] if i < batch else row for i in order])
        return out[position].token_id

    for params in (
        {},
        {"top_p": 0.8, "temperature": 0.7},
        {"top_k": 50, "top_p": 0.5},
        {"min_p": 0.05, "temperature": 1.5},
        {"presence_penalty": 0.5, "repetition_penalty": 1.3, "banned_token_ids": (1, 2)},
    ):
        for step in range(8):
            alone = run(step, 0, 0, sampler_seed=0, **params)
            assert run(step, 3, 5, sampler_seed=1, **params) == alone
            assert run(step, 0, 2, sampler_seed=2, **params) == alone
            assert run(step, 4, 4, sampler_seed=3, **params) == alone


def test_different_seeds_give_different_sequences() -> None:
    logits = torch.zeros(50, 1000)  # uniform: any two sequences of 10 tokens coincide with probability 1e-30
    sequences = []
    for seed in range(50):
        rows = [make_row(seed=seed, num_output_tokens=step) for step in range(10)]
        sequences.append(tuple(t.token_id for t in Sampler()(logits[:10], rows)))
    assert len(set(sequences)) == 50
    steps_of_one_seed = sequences[0]
    assert len(set(steps_of_one_seed)) > 1  # the step number feeds the seed too


def test_row_seed_is_deterministic_and_spreads() -> None:
    assert row_seed(7, 3) == row_seed(7, 3)
    values = {row_seed(seed, step) for seed in range(-50, 50) for step in range(50)}
    assert len(values) == 5000
    assert len({v & 0xFFFFFFFF for v in values}) == 5000  # torch seeds from the low 32 bits
    assert all(0 <= v < 2**63 for v in values)


def test_unseeded_rows_vary_across_calls() -> None:
    sampler = Sampler(seed=0)
    logits = torch.zeros(1, 1000)
    assert len({sampler(logits, [make_row()])[0].token_id for _ in range(20)}) > 10


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0], [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    rows = [
        make_row(
            repetition_penalty=2.0,
            frequency_penalty=0.5,
            presence_penalty=0.25,
            prompt_token_ids=[0, 1],
            output_token_ids=[3, 3, 4, 1],
        ),
        make_row(),
    ]
    apply_penalties_(logits, rows)
    # token 0: prompt, positive -> 2/2; token 1: prompt+output once, negative -> -1*2 - 0.5 - 0.25;
    # token 3: output twice -> 3/2 - 2*0.5 - 0.25; token 4: output once, negative -> -2*2 - 0.5 - 0.25
    expected = torch.tensor([1.0, -2.75, 0.5, 0.25, -4.75, 1.0])
    torch.testing.assert_close(logits[0], expected)
    torch.testing.assert_close(logits[1], torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0]))


def test_frequency_and_presence_ignore_prompt_tokens() -> None:
    logits = torch.zeros(1, 4)
    apply_penalties_(logits, [make_row(frequency_penalty=1.0, presence_penalty=1.0, prompt_token_ids=[0, 1, 2])])
    assert logits.tolist() == [[0.0, 0.0, 0.0, 0.0]]
    apply_penalties_(logits, [make_row(presence_penalty=-0.5, output_token_ids=[2, 2, 2])])
    assert logits.tolist() == [[0.0, 0.0, 0.5, 0.0]]  # negative penalties encourage repetition


def test_penalties_steer_greedy_choice_and_leave_input_alone() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    before = logits.clone()
    row = make_row(temperature=0.0, frequency_penalty=0.6, output_token_ids=[0, 0])  # 5 - 1.2 < 4
    assert Sampler()(logits, [row])[0].token_id == 1
    assert torch.equal(logits, before)


def test_banned_ids_are_never_chosen() -> None:
    logits = torch.tensor([[1.0, 9.0, 8.0, 0.0]])
    assert Sampler()(logits, [make_row(temperature=0.0, banned_token_ids=(1, 2))])[0].token_id == 0
    counts = draw([0.45, 0.45, 0.05, 0.05], 3000, banned_token_ids=(0, 1, 999))  # ids past V are ignored
    assert set(counts) == {2, 3}
    masked = torch.zeros(2, 5)
    apply_bans_(masked, [make_row(banned_token_ids=(4,)), make_row()])
    assert masked[0, 4] == float("-inf") and torch.isfinite(masked[0, :4]).all() and torch.isfinite(masked[1]).all()


def test_logprobs_come_from_the_raw_distribution() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 300, generator=gen)
    rows = [
        make_row(num_logprobs=5, temperature=0.3, top_p=0.5, repetition_penalty=1.5, output_token_ids=[1, 2]),
        make_row(num_logprobs=0, temperature=0.0),
        make_row(),
        make_row(num_logprobs=20, top_k=3, banned_token_ids=(0,)),
    ]
    out = Sampler(seed=0)(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    for i, n in ((0, 5), (1, 0), (3, 20)):
        token = out[i].token_id
        assert out[i].logprob == pytest.approx(raw[i, token].item(), abs=1e-6)
        top = out[i].top_logprobs
        assert top is not None and len(top) == n
        expected = raw[i].topk(n) if n else None
        if expected is not None:
            assert [t for t, _ in top] == expected.indices.tolist()
            assert [v for _, v in top] == pytest.approx(expected.values.tolist(), abs=1e-6)
            assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
    assert out[1].top_logprobs == []
    assert out[2].logprob is None and out[2].top_logprobs is None


def test_padded_vocabulary_is_ignored() -> None:
    logits = torch.zeros(1, 16)
    logits[:, 10:] = 50.0  # padding columns past the tokenizer's 10 tokens
    logits[:, 4] = 1.0
    rows = [
        make_row(temperature=0.0, num_logprobs=2),
        make_row(),
        make_row(top_p=0.5, top_k=5),
        make_row(temperature=0.0, frequency_penalty=2.0, output_token_ids=[4, 12], banned_token_ids=(0, 13)),
    ]
    out = Sampler(vocab_size=10, seed=0)(logits.expand(4, -1), rows)  # a strided view, as a runner may pass
    assert out[0].token_id == 4
    assert out[3].token_id == 1  # 4 is penalised to -1, 0 is banned: the first remaining zero wins
    assert all(t.token_id < 10 for t in out)
    assert out[0].logprob == pytest.approx(1.0 - math.log(9 + math.e), abs=1e-6)


def test_wide_vocabulary_and_large_batch(sampling_path: str) -> None:
    gen = torch.Generator().manual_seed(8)
    vocab = 49152
    logits = torch.randn(64, vocab, generator=gen) * 3
    rows = [
        make_row(
            temperature=0.0 if i % 4 == 0 else 0.8,
            top_p=0.95 if i % 4 == 1 else 1.0,
            top_k=40 if i % 4 == 2 else -1,
            seed=i if i % 8 == 3 else None,
            num_logprobs=3 if i % 5 == 0 else None,
        )
        for i in range(64)
    ]
    with torch.inference_mode():  # as in the model runner's worker thread
        out = Sampler(seed=0)(logits.clone(), rows)
    assert len(out) == 64 and all(0 <= t.token_id < vocab for t in out)
    for i in range(0, 64, 4):
        assert out[i].token_id == logits[i].argmax().item()
    for i in range(2, 64, 4):
        assert out[i].token_id in logits[i].topk(40).indices.tolist()


def test_half_precision_logits_are_accepted() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0]], dtype=torch.bfloat16)
    out = Sampler()(logits, [make_row(temperature=0.0, num_logprobs=1)])
    assert out[0].token_id == 1 and out[0].top_logprobs is not None and out[0].top_logprobs[0][0] == 1


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), [make_row()])


@pytest.mark.parametrize("vocab", [7, 256, 1000, 49152, 50257])
def test_block_argmax_and_topk_match_torch(vocab: int, monkeypatch) -> None:
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=gen)
    x[1, -1] = 100.0  # maximum in the short last block
    x[2] = 0.0  # all tied: the first index wins
    x[3, vocab // 2 :] = float("-inf")
    x[4] = float("-inf")  # nothing finite: the first
    x[5, [vocab // 3, vocab - 1]] = float("nan")  # a NaN is the maximum: its first one
    x[6, -1] = float("inf")
    x[7, [vocab // 2, vocab - 1]] = 50.0  # a tie between the body and the tail
    expected = x.argmax(dim=-1).tolist()
    padded = torch.cat([x, torch.full((9, 5), 1e9)], dim=1)[:, :vocab]  # rows further apart than the vocabulary
    ops = native_ops()
    for isa in available_isas(ops) if ops is not None else []:  # the native pass, on every variant this CPU runs
        use_isa(ops, isa)
        try:
            assert argmax_rows(x).tolist() == expected == argmax_rows(padded).tolist(), isa
        finally:
            use_isa(ops, "best")
    monkeypatch.setattr("engine.sampler._native_ops", lambda: None)
    assert argmax_rows(x).tolist() == expected
    k = min(20, vocab)
    values, ids = topk_rows(x[[0, 1, 3, 8]], k)
    expected = x[[0, 1, 3, 8]].topk(k, dim=-1)
    assert torch.equal(values, expected.values)
    assert torch.equal(ids, expected.indices)


def test_native_rows_take_non_finite_logits_and_rejection_limits(sampling_path: str) -> None:
    vocab = 1000  # not a multiple of any vector width or of the 256-column blocks
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(12))
    logits[0, 7] = float("nan")
    logits[0, 8] = float("inf")  # +inf: the largest float, so the only likely token
    logits[1] = float("-inf")  # nothing finite: uniform
    logits[2, :-1] = float("-inf")  # only the last column, in the short last block
    logits[3] = float("nan")
    rows = [make_row(), make_row(), make_row(top_p=0.5), make_row(), make_row(top_p=1e-30), make_row(top_p=0.0)]
    for seed in range(20):
        tokens = [t.token_id for t in Sampler(seed=seed)(logits.clone(), rows)]
        assert tokens[0] == 8 and tokens[2] == vocab - 1
        assert 0 <= tokens[1] < vocab and 0 <= tokens[3] < vocab
        assert tokens[4] == int(logits[4].argmax()) and tokens[5] == int(logits[5].argmax())  # the nucleus: the top
    uniform = logits[1:2].expand(2000, -1).contiguous()
    spread = Counter(t.token_id for t in Sampler(seed=0)(uniform, [make_row()] * 2000))
    assert len(spread) > 800  # uniform over 1000 columns


def test_native_sampling_refuses_bad_arguments() -> None:
    ops = native_ops()
    if ops is None:
        pytest.skip("the native step is not built (make install builds it)")
    x, one = torch.zeros(2, 10), torch.ones(2)
    with pytest.raises(RuntimeError, match="uniforms"):
        ops.sample_rows(x, one, one, torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match="temperature"):
        ops.sample_rows(x, torch.zeros(2), one, torch.ones(2, 4))
    with pytest.raises(RuntimeError, match="logits"):
        ops.sample_rows(x.double(), one, one, torch.ones(2, 4))
