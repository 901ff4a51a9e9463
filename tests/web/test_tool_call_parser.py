"""The tool-call parser and the call grammars, on text alone: every way of splitting a stream gives the same
content and calls as the whole text; text that may open a call is held back; what is not a call is content."""

import json

import pytest
from transformers import AutoTokenizer

from engine.grammar_compiler import GrammarCompiler
from engine.structured_outputs import StructuredOutputs
from web.tool_calls import ArgumentsPiece, FunctionTool, ToolCallHeader, ToolCallParser, detect_tool_format
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


def test_text_that_may_open_a_call_is_held_back():
    parser = ToolCallParser(HERMES.syntax)
    assert parser.feed("Hello <tool") == ["Hello "]
    assert parser.feed("_ca") == []
    assert parser.feed("ke!") == ["<tool_cake!"]
    assert parser.feed(' <tool_call>{"name": "f", "argu') == [" "]
    events = parser.feed('ments": {"a"')
    assert isinstance(events[0], ToolCallHeader) and events[0].name == "f" and events[1] == ArgumentsPiece(0, '{"a"')


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

    def accepts(grammar: str, text: str) -> bool:
        matcher = compiler.compile(StructuredOutputs(grammar=grammar))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    single, parallel = fmt.call_grammar(tools, False), fmt.call_grammar(tools, True)
    assert accepts(single, one) and not accepts(single, two) and not accepts(single, wrong)
    assert accepts(parallel, one) and accepts(parallel, two)
    if fmt is GENERIC:
        auto = fmt.auto_grammar(tools, True)
        assert accepts(auto, "Plain words.") and accepts(auto, two) and not accepts(auto, wrong)
