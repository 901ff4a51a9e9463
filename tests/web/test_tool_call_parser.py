"""The tool-call parser and the call grammars, on text alone: every way of splitting a stream gives the same
content and calls as the whole text; text that may open a call is held back; what is not a call is content."""

import json
import sys

import pytest
from transformers import AutoTokenizer

from engine.grammar_compiler import GrammarCompiler
from engine.structured_outputs import StructuredOutputs
from web.tool_calls import ArgumentsPiece, FunctionTool, ToolCallHeader, ToolCallParser, detect_tool_format
from web.tool_calls import parser as parser_module
from web.tool_calls.formats import GENERIC, HERMES, LLAMA3_JSON

HERMES_TEXT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"x\\" }", "n": [1, {"a": 2}]}}\n'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)
CASES = [
    (HERMES, HERMES_TEXT, "Let me check. ",
     [("get_weather", '{"city": "Paris \\"x\\" }", "n": [1, {"a": 2}]}'), ("get_time", "{}")]),
    (HERMES, "no call here, <tool_c is not one, nor <tool_call> this </tool_call>", None, []),
    (HERMES, '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>', None, [("f", '{"x": 1}')]),
    (HERMES, '<tool_call>{"name": "f", "arguments": {"x": "cut', None, [("f", '{"x": "cut')]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"y": "}"}}',
     None, [("f", '{"x": 1}'), ("g", '{"y": "}"}')]),
    (LLAMA3_JSON, ' Hello {"name": "f", "parameters": {}}', " Hello {\"name\": \"f\", \"parameters\": {}}", []),
    (LLAMA3_JSON, '{"nope": 1}', '{"nope": 1}', []),
    (GENERIC, "Just text.", "Just text.", []),
    (HERMES, "Hello <tool_c", "Hello <tool_c", []),  # a cut opener after content is content
    (LLAMA3_JSON, '{"answer": [4', '{"answer": [4', []),  # so is JSON cut short that is not a call
]
# Outputs cut short by max_tokens: no markup is content; a call without arguments yet is dropped.
CUT_CASES = [
    (GENERIC, "<tool_c", []),
    (GENERIC, "<tool_call>", []),
    (GENERIC, '<tool_call>{"name": "get_weather", "', []),
    (GENERIC, '<tool_call>{"name": "get_weather", "arguments": ', []),
    (GENERIC, '<tool_call>{"name": "get_weather", "arguments": {"ci', [("get_weather", '{"ci')]),
    (GENERIC, '<tool_call>{"name": "f", "arguments": {}}</tool_c', [("f", "{}")]),
    (GENERIC, '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<', [("f", "{}")]),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {}}\n</', [("f", "{}")]),
    (HERMES, '<tool_call>\n{"arguments": {"x": 1}, "na', []),
    (LLAMA3_JSON, "<|python_ta", []),
    (LLAMA3_JSON, "<|python_tag|> ", []),
    (LLAMA3_JSON, '{"name": "f", "parameters": {}}; ', [("f", "{}")]),
    (LLAMA3_JSON, '{"name": "f", "parameters": {}}; {"na', [("f", "{}")]),
]


def parse(fmt, text: str, step: int):
    parser = ToolCallParser(fmt.syntax)
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i : i + step])
    events += parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    calls: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, ToolCallHeader):
            assert event.index not in calls and event.id.startswith("call_")
            calls[event.index] = [event.name, ""]
        elif isinstance(event, ArgumentsPiece):
            calls[event.index][1] += event.text
    return content, [tuple(c) for c in calls.values()], [(c.name, c.arguments) for c in parser.calls]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_any_split_of_the_stream_parses_like_the_whole_text(fmt, text, content, calls):
    expected_content = text if content is None and not calls else content
    for step in (1, 2, 3, 5, 8, 13, len(text)):
        got_content, streamed_calls, whole_calls = parse(fmt, text, step)
        assert streamed_calls == whole_calls == calls, step
        if expected_content is not None:
            assert got_content == expected_content, step


@pytest.mark.parametrize("fmt,text,calls", CUT_CASES)
def test_an_output_cut_short_leaves_no_markup_in_the_content(fmt, text, calls):
    for step in (1, 2, 3, 5, 8, 13, len(text)):
        assert parse(fmt, text, step) == ("", calls, calls), step


DEEP = "[" * 5000 + "]" * 5000  # deeper than Python's json parses: a model writes it when a user asks it to


@pytest.mark.parametrize("fmt,text", [(HERMES, '<tool_call>{"arguments": ' + DEEP + ', "name": "f"}</tool_call>'),
                                      (LLAMA3_JSON, '{"answer": ' + DEEP + "}")])  # fmt: skip
def test_json_nested_deeper_than_python_parses_is_content(fmt, text):
    """json.loads raised RecursionError out of the parser: a stream was cut without a terminal event, and a whole
    answer was a 400 that blamed the request's JSON."""
    for step in (7, len(text)):
        assert parse(fmt, text, step) == (text, [], []), step


def lines_run(fmt, text: str) -> int:
    """How many lines of the parser run while text is fed a character at a time: a count (sys.settrace), not a time."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename != parser_module.__file__:
            return None
        count += event == "line"
        return trace

    parser, previous = ToolCallParser(fmt.syntax), sys.gettrace()  # a coverage tool's tracer is put back
    sys.settrace(trace)
    try:
        for c in text:
            parser.feed(c)
        parser.finish()
    finally:
        sys.settrace(previous)
    return count


@pytest.mark.parametrize("fmt,opening,closing", [
    (LLAMA3_JSON, '{"answer": "', '"}'),  # a Llama 3 answer in JSON: no call, but held until its object closes
    (HERMES, '<tool_call>{"arguments": {"x": "', '"}, "name": "f"}</tool_call>'),  # "name" not first
    (HERMES, '<tool_call>{"name": "f", "arguments": {}, "note": "', '"}</tool_call>'),  # after the arguments
])  # fmt: skip
def test_the_parser_reads_each_character_of_a_long_object_a_bounded_number_of_times(fmt, opening, closing):
    """The end of an object was searched for from its start at every delta: a 16,000-character answer cost the
    event loop 2 s. Twice the text now costs about twice the work, not four times."""
    short, long = (opening + "ab, " * n + closing for n in (150, 300))
    assert lines_run(fmt, long) < 2.5 * lines_run(fmt, short)


@pytest.mark.parametrize("fmt", [GENERIC, HERMES, LLAMA3_JSON])
def test_every_cut_of_constrained_calls_gives_named_calls_and_no_content(fmt):
    key = fmt.arguments_key
    calls = [fmt.call_open + json.dumps({"name": name, key: {"city": "Paris"}}) + fmt.call_close for name in "fg"]
    text = fmt.call_separator.join(calls)
    for cut in range(len(text) + 1):
        for step in (1, 4, cut or 1):
            content, streamed_calls, whole_calls = parse(fmt, text[:cut], step)
            assert content == "" and streamed_calls == whole_calls, (cut, step)
            assert all(name in "fg" and arguments for name, arguments in whole_calls), (cut, step)


def test_text_that_may_open_a_call_is_held_back():
    parser = ToolCallParser(HERMES.syntax)
    assert parser.feed("Hello <tool") == ["Hello "]
    assert parser.feed("_ca") == []
    assert parser.feed("ke!") == ["<tool_cake!"]
    assert parser.feed(' <tool_call>{"name": "f", "argu') == [" "]
    events = parser.feed('ments": {"a"')
    assert isinstance(events[0], ToolCallHeader) and events[0].name == "f" and events[1] == ArgumentsPiece(0, '{"a"')


def test_the_results_of_parallel_calls_are_one_user_turn_in_generic_mode():
    """Templates that insist on alternating turns (Gemma's) refuse two user turns in a row."""
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": {"i": i}}} for i in range(2)]
    history = GENERIC.history_messages([
        {"role": "user", "content": "Both?"}, {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c0", "content": "zero"},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "user", "content": "Thanks"}, {"role": "tool", "tool_call_id": "c1", "content": "late"},
    ])  # fmt: skip
    assert [m["role"] for m in history] == ["user", "assistant", "user", "user", "user"]
    assert history[2]["content"] == "<tool_response>\nzero\n</tool_response>\n<tool_response>\none\n</tool_response>"
    assert history[4]["content"] == "<tool_response>\nlate\n</tool_response>"


def test_formats_are_chosen_from_the_chat_template():
    assert detect_tool_format("{% for tool in tools %}<tool_call>{% endfor %}") is HERMES
    assert detect_tool_format("{% if tools %}<|python_tag|>{% endif %}") is LLAMA3_JSON
    assert detect_tool_format("{{ messages }}") is GENERIC
    assert detect_tool_format(None) is GENERIC


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, GENERIC])
def test_call_grammars_accept_exactly_calls_of_the_tools(tiny_llama_dir, fmt):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    tools = [FunctionTool("f", None, {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                                      "additionalProperties": False}), FunctionTool("g", "no arguments", {})]  # fmt: skip
    key = fmt.arguments_key
    one = fmt.call_open + json.dumps({"name": "f", key: {"x": 12}}) + fmt.call_close
    two = one + fmt.call_separator + fmt.call_open + json.dumps({"name": "g", key: {}}) + fmt.call_close
    wrong = fmt.call_open + json.dumps({"name": "f", key: {"x": "12"}}) + fmt.call_close
    no_parameters = fmt.call_open + json.dumps({"name": "g", key: {"x": 1}}) + fmt.call_close  # g takes none

    def accepts(grammar: str, text: str) -> bool:
        matcher = compiler.compile(StructuredOutputs(grammar=grammar))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    single, parallel = fmt.call_grammar(tools, False), fmt.call_grammar(tools, True)
    assert accepts(single, one) and not accepts(single, two) and not accepts(single, wrong)
    assert not accepts(single, no_parameters)
    assert accepts(parallel, one) and accepts(parallel, two)
    if fmt is GENERIC:
        auto = fmt.auto_grammar(tools, True)
        assert accepts(auto, "Plain words.") and accepts(auto, two) and not accepts(auto, wrong)
        # text, then a call: the parser would read an unconstrained call (of any name) out of the text
        assert not accepts(auto, "Sure! " + one) and not accepts(auto, "Sure! <tool_call>{}</tool_call> done")
