"""With a reasoning parser, a grammar starts after the thought (engine/thought_grammar.py): the masks of the tiny
Qwen 3 tokenizer's tokens (<think> and </think> are single tokens there) at each point of a thought then JSON."""

from __future__ import annotations

import numpy as np
import pytest

from engine.grammar_compiler import GrammarCompiler
from engine.reasoning_parser import REASONING_PARSERS, Phase
from engine.structured_outputs import StructuredOutputs
from engine.thought_grammar import ThoughtMarkers, thought_markers
from tests.support.tiny_models import build_qwen3_tokenizer

SCHEMA = StructuredOutputs(json={"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})


@pytest.fixture(scope="module")
def tokenizer():
    return build_qwen3_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def markers(tokenizer) -> ThoughtMarkers:
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    found = thought_markers(REASONING_PARSERS["qwen3"], {"<think>": start, "</think>": end})
    assert found == ThoughtMarkers(REASONING_PARSERS["qwen3"], end, start)
    return found


def allowed(matcher) -> set[int]:
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def feed(matcher, tokenizer, text: str) -> None:
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.consume_token(token_id), (text, matcher.get_error())


def test_a_thought_is_free_text_up_to_the_end_token_and_then_the_grammar_holds(compiler, tokenizer, markers) -> None:
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    matcher = compiler.compile(SCHEMA, markers, Phase.BEFORE)
    assert allowed(matcher) == {markers.start_token_id, brace}  # a thought may open, or the answer start at once
    assert matcher.consume_token(markers.start_token_id)
    feed(matcher, tokenizer, "not JSON at all {[")
    in_thought = allowed(matcher)
    assert markers.end_token_id in in_thought and tokenizer.eos_token_id not in in_thought and len(in_thought) > 100
    assert matcher.consume_token(markers.end_token_id)
    assert allowed(matcher) == {brace}
    feed(matcher, tokenizer, '{"ok": true}')
    assert matcher.is_accepting()


def test_qwen3_output_that_opens_no_thought_is_held_to_the_grammar_from_its_first_token(compiler, tokenizer,
                                                                                         markers) -> None:  # fmt: skip
    matcher = compiler.compile(SCHEMA, markers, Phase.BEFORE)
    feed(matcher, tokenizer, '{"ok": ')
    assert markers.start_token_id not in allowed(matcher) and markers.end_token_id not in allowed(matcher)


def test_the_thought_never_spells_the_end_marker_as_text(compiler, tokenizer, markers) -> None:
    matcher = compiler.compile(SCHEMA, markers, Phase.OPENING)
    feed(matcher, tokenizer, "a</think")
    closers = {t for t in range(len(tokenizer)) if "</think>" in "</think" + tokenizer.decode([t])}
    closers.discard(markers.end_token_id)
    assert closers and not closers & allowed(matcher)


def test_an_open_thought_must_end_before_the_answer(compiler, tokenizer, markers) -> None:
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    matcher = compiler.compile(SCHEMA, markers, Phase.OPENING)
    first = allowed(matcher)
    assert {markers.start_token_id, markers.end_token_id, brace} <= first and tokenizer.eos_token_id not in first
    feed(matcher, tokenizer, "{")  # thought text, not the answer
    assert matcher.consume_token(markers.end_token_id)
    assert allowed(matcher) == {brace}


def test_a_closed_thought_no_parser_and_a_grammar_naming_the_end_marker_keep_the_grammar_as_it_is(
    compiler, markers
) -> None:
    plain = allowed(compiler.compile(SCHEMA))
    assert allowed(compiler.compile(SCHEMA, markers, Phase.ANSWER)) == plain
    own = StructuredOutputs(grammar=f'start: <[{markers.start_token_id}]> "a" <[{markers.end_token_id}]> "b"')
    assert allowed(compiler.compile(own, markers, Phase.BEFORE)) == {markers.start_token_id}


def test_an_end_marker_that_is_no_single_token_names_no_markers() -> None:
    assert thought_markers(REASONING_PARSERS["qwen3"], {"<think>": 5}) is None
    assert thought_markers(None, {}) is None


def test_where_the_output_starts_is_read_once_and_carried_to_a_replica_that_compiles_its_own_grammar(
    tokenizer, markers
) -> None:
    """The input processor reads the prompt's tail once (PreparedRequest.first_phase): the web's splitter takes it,
    and a replica, whose grammar matcher cannot travel from the front, compiles after the same thought. A front
    knows the parser but not the markers' tokens; the engine both."""
    from engine.input_processor import InputProcessor
    from engine.sampling_params import SamplingParams

    def processor(with_markers: bool) -> InputProcessor:
        p = InputProcessor(tokenizer, len(tokenizer), 256, [tokenizer.eos_token_id])
        p.reasoning_syntax = markers.syntax
        p.thought_markers = markers if with_markers else None
        return p

    front, replica = processor(False), processor(True)
    params = SamplingParams(max_tokens=8, structured_outputs=SCHEMA)
    body = tokenizer.encode("user: hi\nassistant:", add_special_tokens=False)
    opened, closed = body + [markers.start_token_id], body + tokenizer.encode("<think>\n\n</think>\n\n")
    cases = [(body, Phase.BEFORE), (opened, Phase.OPENING), (closed, Phase.ANSWER)]
    for prompt, phase in cases:
        prepared = front.process_prompt("r", prompt, params)
        assert prepared.first_phase is phase and replica.process_prompt("r", prompt, params).first_phase is phase
        matcher = replica.compile_grammar(params.structured_outputs, prepared.first_phase)
        assert (markers.end_token_id in allowed(matcher)) is (phase is Phase.OPENING)
        assert (markers.start_token_id in allowed(matcher)) is (phase is not Phase.ANSWER)
    no_parser = InputProcessor(tokenizer, len(tokenizer), 256, [tokenizer.eos_token_id])
    assert no_parser.process_prompt("r", opened, params).first_phase is Phase.ANSWER


def test_offline_generate_holds_the_grammar_from_the_first_token_and_chat_after_deepseek_r1s_thought(
    tiny_qwen3_dir, markers
) -> None:
    """LLM.generate's prompt is no chat template's: no thought from the start (the JSON at once, not free text up to
    max_tokens waiting for a </think>); LLM.chat's is, so its thought comes first."""
    import json

    from engine import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(str(tiny_qwen3_dir), dtype="float32", num_threads=1, num_kv_blocks=64, reasoning_parser="deepseek_r1")
    h = llm.engine.tokenizer.encode("h", add_special_tokens=False)[0]
    closed = StructuredOutputs(json={**SCHEMA.json, "additionalProperties": False})  # type: ignore[dict-item]
    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs=closed, presence_penalty=2,
                            frequency_penalty=2, logit_bias={h: 50, markers.end_token_id: 45})  # fmt: skip
    [generated] = llm.generate("Answer in JSON:", params, use_tqdm=False)
    assert json.loads(generated.text) in ({"ok": True}, {"ok": False}), generated.text
    [chatted] = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)
    thought, end, answer = chatted.text.partition("</think>")
    assert thought and set(thought) == {"h"} and json.loads(answer) in ({"ok": True}, {"ok": False}), chatted.text


def test_preemption_mid_thought_keeps_each_outputs_grammar_where_it_was(tiny_qwen3_dir, markers) -> None:
    """A pool too small for 8 thoughts at once preempts some (recomputed later): the outputs, each a thought then
    the JSON, are those of a pool with room for all."""
    from engine import LLM
    from engine.sampling_params import SamplingParams

    closed = StructuredOutputs(json={**SCHEMA.json, "additionalProperties": False})  # type: ignore[dict-item]

    def run(num_kv_blocks: int) -> tuple[list[str], int]:
        llm = LLM(str(tiny_qwen3_dir), dtype="float32", num_threads=1, block_size=4, max_num_seqs=8,
                  num_kv_blocks=num_kv_blocks, reasoning_parser="deepseek_r1")  # fmt: skip
        h = llm.engine.tokenizer.encode("h", add_special_tokens=False)[0]
        bias = {h: 50, markers.end_token_id: 45}  # thoughts of "h" that end after more of them the less penalised
        params = [SamplingParams(max_tokens=60, temperature=0, structured_outputs=closed, logit_bias=bias,
                                 frequency_penalty=0.2 + i / 20) for i in range(8)]  # fmt: skip
        conversations = [[{"role": "user", "content": f"Hi {i} " * (i + 1)}] for i in range(8)]
        return [r.text for r in llm.chat(conversations, params, use_tqdm=False)], llm.engine.num_preemptions

    roomy, num_preempted = run(256)
    tight, num_tight_preempted = run(40)
    assert num_preempted == 0 and num_tight_preempted > 0
    assert tight == roomy and all("</think>{" in text for text in roomy), roomy
