"""Constrained decoding in the engine: every kind of constraint, finish reasons, compile errors, mixed batches,
preemption and aborts (tiny random model, whose unconstrained output is noise: only the grammar shapes it)."""

import json
import re

import jsonschema
import pytest
import torch

from engine import SamplingParams, grammar_clock
from engine.batch import SamplingRow
from engine.errors import InvalidRequest
from engine.grammar_mask import GrammarMasker
from engine.structured_outputs import MAX_CHOICES, StructuredOutputs

from tests.support.engine_helpers import assert_pool_full, make_llm

PROMPTS = ["Hello world", "The quick brown fox", "def add(a, b):", "Numbers 0123"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"enum": ["small", "large"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "size", "count", "tags"],
    "additionalProperties": False,
}


def constrained(max_tokens: int = 80, temperature: float = 1.0, seed: int | None = 7, **kind) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured_outputs=StructuredOutputs(**kind))  # fmt: skip


def test_json_schema_output_parses_and_validates(llm):
    outs = llm.generate(PROMPTS, constrained(json=SCHEMA), use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_object_regex_and_choice_are_enforced(llm):
    objects = llm.generate(PROMPTS, constrained(json_object=True), use_tqdm=False)
    assert all(isinstance(json.loads(o.text), dict) for o in objects if o.finish_reason == "stop")
    assert any(o.finish_reason == "stop" for o in objects)
    for out in llm.generate(PROMPTS, constrained(regex=r"[a-c]{2,4}-[0-9]"), use_tqdm=False):
        assert re.fullmatch(r"[a-c]{2,4}-[0-9]", out.text) and out.finish_reason == "stop", out.text
    choices = ["yes", "no", "maybe so", "日本", 'a "quoted" one']
    for out in llm.generate(PROMPTS, constrained(choice=choices), use_tqdm=False):
        assert out.text in choices and out.finish_reason == "stop"


def test_lark_grammar_is_enforced(llm):
    grammar = 'start: "(" item ("," item)* ")"\nitem: /[0-9]{1,2}/ | "x"'
    for out in llm.generate(PROMPTS, constrained(grammar=grammar), use_tqdm=False):
        if out.finish_reason == "stop":
            assert re.fullmatch(r"\((?:[0-9]{1,2}|x)(?:,(?:[0-9]{1,2}|x))*\)", out.text), out.text
        else:  # a long list cut by max_tokens
            assert re.fullmatch(r"\((?:[0-9]{1,2}|x)(?:,(?:[0-9]{1,2}|x)?)*", out.text), out.text


def test_a_complete_grammar_stops_and_max_tokens_cuts_with_length(llm):
    whole = llm.generate(["Hello"], constrained(regex="a{6}"), use_tqdm=False)[0]
    assert (whole.text, whole.finish_reason) == ("aaaaaa", "stop")
    cut = llm.generate(["Hello"], constrained(regex="a{6}", max_tokens=3), use_tqdm=False)[0]
    assert cut.finish_reason == "length" and "aaaaaa".startswith(cut.text) and len(cut.token_ids) == 3


def test_unconstrained_rows_of_a_mixed_batch_are_unchanged(llm):
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(PROMPTS, free, use_tqdm=False)]
    mixed = llm.generate(PROMPTS * 2, [free] * 4 + [constrained(json=SCHEMA, temperature=0)] * 4, use_tqdm=False)
    assert [o.token_ids for o in mixed[:4]] == alone
    for out in mixed[4:]:
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_preemption_keeps_each_matcher_with_its_tokens(tiny_llama_dir):
    params = constrained(json=SCHEMA, temperature=0, seed=None)
    roomy = make_llm(tiny_llama_dir)
    expected = [o.token_ids for o in roomy.generate(PROMPTS * 2, params, use_tqdm=False)]
    tight = make_llm(tiny_llama_dir, num_kv_blocks=40, block_size=4, max_num_seqs=8)
    outs = tight.generate(PROMPTS * 2, params, use_tqdm=False)
    assert tight.engine.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert_pool_full(tight)


def test_abort_of_a_constrained_request_frees_its_blocks(llm):
    engine = llm.engine
    engine.add_request("json", "Hello world", constrained(json=SCHEMA))
    engine.step()
    engine.step()
    finals = engine.abort("json")
    assert [f.finish_reason for f in finals] == ["abort"]


@pytest.mark.parametrize(
    "kind,param",
    [
        (dict(regex="a(b"), "structured_outputs.regex"),
        (dict(json={"type": "no-such-type"}), "structured_outputs.json"),
        (dict(json="{not json"), "structured_outputs.json"),
        (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
        (dict(json={"type": "foo"}, param="response_format"), "response_format"),
        # compiles, but to the empty output only: no JSON value satisfies it (was: "" and finish_reason "stop")
        (dict(json={"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}), "structured_outputs.json"),
    ],
)
def test_a_constraint_that_does_not_compile_is_invalid_naming_its_parameter(llm, kind, param):
    with pytest.raises(InvalidRequest) as error:
        llm.generate(["Hello"], constrained(**kind), use_tqdm=False)
    assert error.value.param == param


def test_the_longest_choice_list_runs_under_the_parsers_row_limit(llm):
    """Each entry of a choice is an item of the parse's first row: MAX_ROW_ITEMS leaves room for all of them."""
    words = [f" w{i}x" for i in range(MAX_CHOICES)]
    (out,) = llm.generate(["Pick one:"], constrained(choice=words), use_tqdm=False)
    assert out.finish_reason == "stop" and out.text in words


def test_a_wide_flat_schema_is_followed(llm):
    """400 properties of 20 values each, the last required: its parse holds ~1,600 items at once (the row limit was
    1,100, and such a request failed at its first token)."""
    schema = {"type": "object", "additionalProperties": False, "required": ["f399"], "properties": {
        f"f{i}": {"enum": [f"v{i}_{k}" for k in range(20)]} for i in range(400)}}  # fmt: skip
    outs = llm.generate(PROMPTS, constrained(json=schema, max_tokens=60), use_tqdm=False)
    for out in outs:
        assert out.finish_reason in ("stop", "length") and out.text.startswith('{"f'), out.text
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)


def test_the_grammar_clock_counts_every_constrained_token(llm, monkeypatch):
    """With no time allowed, a constrained request fails at its first token, through the mask's time and the
    advance's, and the unconstrained one beside it does not."""
    monkeypatch.setattr(grammar_clock, "FLOOR_SECONDS", -1.0)
    monkeypatch.setattr(grammar_clock, "MAX_MS_PER_TOKEN", -1.0)
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    failed_request, other = llm.generate(PROMPTS[:2], [constrained(json=SCHEMA), plain], use_tqdm=False)
    failed = failed_request.outputs[0]
    assert failed.finish_reason == "error" and failed.error_code == "structured_output_failed"
    assert "over 1 tokens" in failed.error and failed.token_ids == []  # the token that overran is not sent
    assert other.finish_reason == "length" and len(other.token_ids) == 8


def test_the_grammar_clock_bounds_the_recent_cost_past_a_floor():
    clock = grammar_clock.GrammarClock()
    clock.add_mask(0.2)  # a costly first mask (a large schema's lexer) ends nothing
    assert clock.on_token(0.001) is None
    for _ in range(200):  # then 1 ms a token: under the bound however long it runs
        clock.add_mask(0.0009)
        assert clock.on_token(0.0001) is None
    assert clock.num_tokens == 201 and clock.seconds == pytest.approx(0.401)
    overruns = []
    while not overruns:  # then 20 ms a token: over the bound within a few tokens
        clock.add_mask(0.02)
        overruns = [message] if (message := clock.on_token(0.0)) else []
    assert 201 < clock.num_tokens <= 210 and "ms a token lately (at most 5 ms)" in overruns[0]
    assert clock.unread_mask_seconds == 0


def test_bad_constraint_values_are_invalid_on_construction():
    not_json = dict(json={"enum": {"a", "b"}})  # a Python set: no JSON holds it
    for kind in (dict(), dict(regex="a", choice=["a"]), dict(choice=[]), dict(regex=""), dict(json=3), not_json):
        with pytest.raises(InvalidRequest):
            StructuredOutputs(**kind)
    with pytest.raises(InvalidRequest) as error:
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputs(regex="a+"))
    assert error.value.param == "min_tokens"


def test_the_mask_leaves_only_what_the_grammar_allows(llm):
    compiler = llm.engine.input_processor.grammar_compiler
    matcher = compiler.compile(StructuredOutputs(choice=["Hello", "world"]))
    vocab = compiler.vocab_size
    rows = [SamplingRow(1.0, -1, 1.0, 0.0, 0.0, 0.0, 1.0, None, None, 0, [], [], matcher=m) for m in (None, matcher)]
    logits = torch.zeros(2, vocab)
    logits[1, 0] = float("inf")  # a forbidden token at +inf (or NaN) still loses
    logits[1, 1] = float("nan")
    GrammarMasker().apply_(logits, rows)
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    tokenizer = llm.tokenizer
    assert allowed and all(any(w.startswith(tokenizer.decode([t])) for w in ("Hello", "world")) for t in allowed)
    assert logits[1, 0] == float("-inf") and logits[1, 1] == float("-inf")
    assert torch.isfinite(logits[0]).all()


@pytest.mark.parametrize("prompt", ["Hi", "A prompt long enough to fill a few KV blocks before its choices fork"])
def test_each_of_n_choices_follows_the_grammar_with_a_matcher_of_its_own(llm, prompt):
    params = constrained(json=SCHEMA)
    params.n = 3
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert len(out.outputs) == 3
    for choice in out.outputs:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    assert len({c.text for c in out.outputs}) > 1  # seed + i: the choices differ, each grammar state its own
