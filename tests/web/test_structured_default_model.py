"""Structured outputs and tool calls on the real default model (SmolLM2-135M-Instruct), through the openai
client, streaming and not: JSON that parses and validates, calls that name a tool with valid arguments,
parallel calls, a tool result sent back and a final answer; every request's blocks come back."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from engine.config import EngineConfig

from tests.support.server_harness import ThreadedServer, llm_engine_loader

MODEL = "smollm2"
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "integer"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "array_of_enums": {
        "type": "object",
        "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}},
        "required": ["colors"],
    },
    "numbers": {
        "type": "object",
        "properties": {"temperature": {"type": "number"}, "count": {"type": "integer", "minimum": 0, "maximum": 100},
                       "ok": {"type": "boolean"}},
        "required": ["temperature", "count", "ok"],
    },  # fmt: skip
    "list_of_objects": {
        "type": "array",
        "items": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "population": {"type": "integer"}}, "required": ["city", "population"]},
        "minItems": 1, "maxItems": 2,
    },  # fmt: skip
}
PROMPTS = {
    "nested": "Give a person's name and address as JSON.",
    "array_of_enums": "List some colors of the flag of France as JSON.",
    "numbers": "Describe the weather in Paris as JSON.",
    "list_of_objects": "Name two big cities and their population as JSON.",
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}}},
]  # fmt: skip
QUESTION = [{"role": "user", "content": "What is the weather in Paris and what time is it in Tokyo?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    config = EngineConfig(model="", num_kv_blocks=256, max_num_seqs=16, enable_prefix_caching=False)
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL) as server:
        yield server
        engine = server.engine
        assert not engine.has_unfinished_requests
        assert engine.num_free_blocks == engine.num_total_blocks


@pytest.fixture(scope="module")
def client(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def stream_text_and_calls(client: openai.OpenAI, **body) -> tuple[str, list[tuple[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **body):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_output_parses_and_validates(client: openai.OpenAI, name: str) -> None:
    schema = SCHEMAS[name]
    body = dict(
        messages=[{"role": "user", "content": PROMPTS[name]}], max_tokens=120, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
    )  # fmt: skip
    whole = client.chat.completions.create(model=MODEL, **body).choices[0]
    assert whole.finish_reason == "stop", whole.message.content
    jsonschema.validate(json.loads(whole.message.content), schema)
    streamed, _, finish = stream_text_and_calls(client, **body)
    assert (streamed, finish) == (whole.message.content, "stop")


def test_json_object_on_completions(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt="A JSON object describing a cat:", max_tokens=60,
                                       temperature=0, extra_body={"response_format": {"type": "json_object"}})  # fmt: skip
    choice = result.choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.text), dict)


def valid_calls(calls: list[tuple[str, str]]) -> None:
    for name, arguments in calls:
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
        jsonschema.validate(json.loads(arguments), schema)


def test_required_tool_calls_in_parallel_streamed_and_not(client: openai.OpenAI) -> None:
    body = dict(messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=150, temperature=0)
    whole = client.chat.completions.create(model=MODEL, **body).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    valid_calls(calls)
    assert {name for name, _ in calls} == {"get_weather", "get_time"}, calls  # two calls in one answer
    assert len({c.id for c in whole.message.tool_calls}) == len(calls)
    assert stream_text_and_calls(client, **body) == ("", calls, "tool_calls")


def test_a_named_function_then_its_result_and_a_final_answer(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=named,
                                           max_tokens=60, temperature=0).choices[0]  # fmt: skip
    assert first.finish_reason == "tool_calls"
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather"
    valid_calls([(call.function.name, call.function.arguments)])
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})},
    ]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=60,
                                           temperature=0).choices[0]  # fmt: skip
    assert final.finish_reason == "stop" and final.message.content and not final.message.tool_calls
    assert "<tool_call>" not in final.message.content


def test_auto_in_generic_mode_never_calls_a_function_that_is_not_among_the_tools(client: openai.OpenAI) -> None:
    """Earlier turns that wrote a call to another function after some words: the model does so again, greedy. Plain
    text may not hold a call's opener (the calls a grammar writes are the only ones read), so no call names it."""
    shot = 'Sure! <tool_call>{"name": "lookup_stock", "arguments": {"ticker": "%s"}}</tool_call>'
    messages = []
    for ticker in ("AAPL", "MSFT", "GOOG"):
        messages += [{"role": "user", "content": f"Price of {ticker}?"},
                     {"role": "assistant", "content": shot % ticker}]  # fmt: skip
    body = dict(messages=[*messages, {"role": "user", "content": "Price of TSLA?"}], tools=TOOLS[:1],
                tool_choice="auto", max_tokens=40, temperature=0)  # fmt: skip
    whole = client.chat.completions.create(model=MODEL, **body).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert all(name == "get_weather" for name, _ in calls), calls
    assert "<tool_call>" not in (whole.message.content or "")
    assert stream_text_and_calls(client, **body) == (whole.message.content or "", calls, whole.finish_reason)


def test_required_calls_cut_by_max_tokens_leave_no_markup_streamed_or_not(client: openai.OpenAI) -> None:
    for max_tokens in range(2, 36, 3):  # cuts in the opener, the name, the arguments, the closer, the next call
        body = dict(messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=max_tokens, temperature=0)
        whole = client.chat.completions.create(model=MODEL, **body).choices[0]
        assert whole.finish_reason == "length" and whole.message.content is None, (max_tokens, whole.message)
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert all(name in ("get_weather", "get_time") and arguments for name, arguments in calls), max_tokens
        assert stream_text_and_calls(client, **body) == ("", calls, "length"), max_tokens


def test_a_function_declared_without_parameters_is_called_without_arguments(client: openai.OpenAI) -> None:
    for question, seed in [("Call f", 0), ("Ring the bell 3 times, loudly.", 1)]:  # once wrote arguments for these
        body = dict(messages=[{"role": "user", "content": question}], tools=[{"type": "function", "function": {
            "name": "f"}}], tool_choice="required", parallel_tool_calls=False, max_tokens=40, seed=seed)  # fmt: skip
        whole = client.chat.completions.create(model=MODEL, **body).choices[0]
        assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [("f", "{}")], seed


def test_tools_with_an_answer_format_call_or_answer_in_the_format(server: ThreadedServer, client: openai.OpenAI) -> None:
    """An agent's turn (tools and an output type): the model calls, or, with the call's opener banned, answers in
    the format; both through the SDK's parse helper, streamed output equal to whole."""
    answer = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
              "sky": {"type": "string", "maxLength": 20}}, "required": ["city", "sky"], "additionalProperties": False}  # fmt: skip
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer, "strict": True}}
    opener = server.engine.input_processor.tokenizer.encode("<tool_call>", add_special_tokens=False)[0]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for logit_bias, finish in [(None, "tool_calls"), ({str(opener): -100}, "stop")]:
        body = dict(messages=messages, tools=TOOLS, response_format=response_format, max_tokens=100, temperature=0,
                    logit_bias=logit_bias, parallel_tool_calls=False)  # fmt: skip
        whole = client.chat.completions.create(model=MODEL, **body).choices[0]
        assert whole.finish_reason == finish, whole
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        if finish == "tool_calls":
            valid_calls(calls)
            assert whole.message.content is None
        else:
            jsonschema.validate(json.loads(whole.message.content), answer)
            assert not calls
        assert stream_text_and_calls(client, **body) == (whole.message.content or "", calls, finish)


def test_a_grammar_past_its_parsers_limits_fails_its_request_alone_with_a_400(
    server: ThreadedServer, client: openai.OpenAI
) -> None:
    """llguidance stops a grammar that outgrows its limits while the output runs (a regex of a million states, a
    schema that must recurse forever): the client's 400 (or the stream's error event) with a short message, not an
    engine failure (a 500 with the parser's state in it, counted in sluice_requests_failed_total)."""
    endless = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                                                     "required": ["c"]}}}  # fmt: skip
    http = httpx.Client(base_url=server.base_url, timeout=120)
    failed_before = metric(http, "sluice_requests_failed_total")
    for constraint in [{"regex": "a{1000000}"}, {"json": endless}]:
        body = dict(messages=[{"role": "user", "content": "say a"}], max_tokens=300,
                    extra_body={"structured_outputs": constraint})  # fmt: skip
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, **body)
        error = refused.value.body
        assert error["code"] == "structured_output_failed" and error["type"] == "invalid_request_error"
        assert error["message"].startswith("structured output failed: token ") and "Parser:" not in error["message"]
        assert "lexer error" not in error["message"] and "too large" in error["message"] or "regex" not in constraint
        stream = {"model": MODEL, "prompt": "say a", "max_tokens": 300, "stream": True,
                  "structured_outputs": constraint}  # fmt: skip
        with http.stream("POST", "/v1/completions", json=stream) as response:
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "structured_output_failed"
    response = http.post("/v1/responses", json={"model": MODEL, "input": "say a", "max_output_tokens": 300, "text": {
        "format": {"type": "json_schema", "name": "endless", "schema": endless}}})  # fmt: skip
    assert response.status_code == 400 and response.json()["error"]["code"] == "structured_output_failed"
    assert metric(http, "sluice_requests_failed_total") == failed_before
    assert metric(http, 'sluice_requests_finished_total{finished_reason="error"}') >= 4
    # An ambiguous grammar's parse grows with its output, and every request's step waits for it: it fails on the
    # time it costs (engine/grammar_clock.py), well before llguidance's row limit (~150 tokens, seconds later).
    ambiguous = {"grammar": 'start: x\nx: "a" | x x | x x x | "a" x'}
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="say a", max_tokens=300, extra_body={"structured_outputs": ambiguous})
    assert refused.value.body["code"] == "structured_output_failed"
    assert refused.value.body["message"].startswith("structured output failed: evaluating the grammar took ")
    assert client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5).choices[0].finish_reason


def metric(http: httpx.Client, name: str) -> float:
    lines = [line for line in http.get("/metrics").text.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0
