"""Tool calls through the server on tiny models whose chat templates have a tool format (Hermes-style and
Llama 3-style): the template renders tools and the call history, calls are parsed, and streamed deltas joined
by the openai client equal the non-streamed calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.support.server_harness import ThreadedServer, llm_engine_loader, tiny_engine_config
from tests.support.tiny_models import build_tokenizer, save_tiny_llama
from tests.support.tool_templates import HERMES_TEMPLATE, LLAMA3_TEMPLATE


MODEL = "tiny-tools"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["hour"]}}},
]  # fmt: skip
MESSAGES = [{"role": "user", "content": "Hello world"}]


def tiny_model_with_template(path: Path, template: str, added_tokens: list[str]) -> Path:
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(added_tokens)  # as in Qwen 2.5: <tool_call> is one token, and not a special one
    tokenizer.chat_template = template
    return save_tiny_llama(path, tokenizer=tokenizer, vocab_size=len(tokenizer), max_position_embeddings=2048)


@pytest.fixture(scope="module", params=["hermes", "llama3"])
def server(request, tmp_path_factory) -> Iterator[ThreadedServer]:
    if request.param == "hermes":
        model_dir = tiny_model_with_template(tmp_path_factory.mktemp("hermes"), HERMES_TEMPLATE, ["<tool_call>", "</tool_call>"])
    else:
        model_dir = tiny_model_with_template(tmp_path_factory.mktemp("llama3"), LLAMA3_TEMPLATE, [])
    config = tiny_engine_config(model_dir, max_model_len=2048, num_kv_blocks=1024)
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL) as server:
        server.family = request.param
        yield server


@pytest.fixture(scope="module")
def client(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def streamed_calls(client: openai.OpenAI, **body) -> tuple[str | None, list[tuple[str, str]], str]:
    """The openai client's own reassembly of a stream: content, (name, arguments) per call, finish reason."""
    content, calls, finish = None, {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **body):
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.content:
            content = (content or "") + delta.content
        for call in delta.tool_calls or []:
            if call.index not in calls:
                assert call.id and call.type == "function" and call.function.name, "a call's first delta names it"
                calls[call.index] = [call.function.name, call.function.arguments or ""]
            else:
                assert call.id is None and call.function.name is None, "later deltas carry arguments only"
                calls[call.index][1] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_constrained_calls_stream_as_they_are_returned_whole(client: openai.OpenAI, tool_choice) -> None:
    # One call: a random model given parallel calls goes on calling until max_tokens.
    body = dict(messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=200,
                temperature=0)  # fmt: skip
    whole = client.chat.completions.create(model=MODEL, **body)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert calls and choice.message.content is None
    for name, arguments in calls:
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
        jsonschema.validate(json.loads(arguments), schema)
    if isinstance(tool_choice, dict):
        assert [name for name, _ in calls] == ["get_time"]
    assert streamed_calls(client, **body) == (None, calls, "tool_calls")
    # The SDK's stream helper keeps what the role chunk says: content null, as OpenAI streams calls (not "")
    with client.chat.completions.stream(model=MODEL, **body) as stream:
        assert stream.get_final_completion().choices[0].message.content is None


def test_a_call_a_stop_string_cuts_in_its_arguments_finishes_stop_not_tool_calls(client: openai.OpenAI) -> None:
    """finish_reason "tool_calls" told the client to run a call whose arguments were not JSON."""
    body = dict(messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                parallel_tool_calls=False, max_tokens=200, temperature=0, stop=["hour"])  # fmt: skip
    choice = client.chat.completions.create(model=MODEL, **body).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls, choice
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.tool_calls[0].function.arguments)
    assert streamed_calls(client, **body)[2] == "stop"


def test_the_template_renders_tools_and_the_call_history(server: ThreadedServer) -> None:
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 degrees"},
    ]  # fmt: skip
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        body = {"model": MODEL, "messages": history, "tools": TOOLS, "max_tokens": 8, "temperature": 0}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
        tokens = http.post("/tokenize", json={"model": MODEL, "messages": history}).json()["tokens"]
        prompt = http.post("/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]
    assert '"name": "get_weather", ' in prompt and "-3 degrees" in prompt
    if server.family == "hermes":
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}' in prompt
    else:
        assert '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}' in prompt
    assert server.engine.num_free_blocks == server.engine.num_total_blocks


def test_auto_lets_the_model_choose_and_the_answer_is_content_or_calls(client: openai.OpenAI) -> None:
    body = dict(messages=MESSAGES, tools=TOOLS, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(model=MODEL, **body).choices[0]
    content, calls, finish = streamed_calls(client, **body)
    assert content == whole.message.content
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert finish == whole.finish_reason
    opening = next(iter(client.chat.completions.create(model=MODEL, stream=True, **body)))
    assert opening.choices[0].delta.role == "assistant" and opening.choices[0].delta.content is None  # OpenAI's


# As pydantic writes a model with an Enum field (openai.pydantic_function_tool): "$ref"s into the schema's own
# "$defs". Both tools name a def "Unit", each its own.
TOOLS_WITH_DEFS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"], "type": "string"}},
        "type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"]}}},
    {"type": "function", "function": {"name": "get_depth", "parameters": {
        "definitions": {"Unit": {"enum": ["m", "ft"]}},
        "type": "object", "properties": {"unit": {"$ref": "#/definitions/Unit"}, "next": {"$ref": "#"}},
        "required": ["unit"]}}},
]  # fmt: skip


@pytest.mark.parametrize("name", ["get_weather", "get_depth"])
def test_tool_parameters_may_refer_to_their_own_definitions(client: openai.OpenAI, name: str) -> None:
    body = dict(messages=MESSAGES, tools=TOOLS_WITH_DEFS, tool_choice={"type": "function", "function": {"name": name}},
                max_tokens=200, temperature=0)  # fmt: skip
    choice = client.chat.completions.create(model=MODEL, **body).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    schema = next(t["function"]["parameters"] for t in TOOLS_WITH_DEFS if t["function"]["name"] == name)
    for call in choice.message.tool_calls:
        assert call.function.name == name
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_ref_inside_the_clients_data_is_left_as_written(client: openai.OpenAI) -> None:
    """A "$ref" key under const (an instance, not a schema) is the client's data: rebasing refs leaves it."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"const": {"$ref": "#/literal"}}, "y": {"$ref": "#/$defs/Y"}},
        "required": ["x", "y"], "$defs": {"Y": {"enum": [1, 2]}}}}}  # fmt: skip
    choice = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[tool], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=100, temperature=0).choices[0]  # fmt: skip
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert arguments["x"] == {"$ref": "#/literal"} and arguments["y"] in (1, 2), arguments


def test_a_tool_whose_parameters_do_not_compile_is_named(client: openai.OpenAI) -> None:
    broken = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"unit": {"$ref": "#/$defs/Missing"}}}}}  # fmt: skip
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[*TOOLS, broken], tool_choice="required",
                                       max_tokens=8)  # fmt: skip
    error = caught.value.body
    assert error["param"] == "tools"
    assert error["message"].startswith("the parameters of tool 'broken' are not a usable JSON schema")
    assert "/$defs/Missing" in error["message"] and "%json" not in error["message"]


ANSWER = {"type": "object", "properties": {"sky": {"enum": ["sunny", "grey"]}}, "required": ["sky"],
          "additionalProperties": False}  # fmt: skip


def test_auto_with_an_answer_format_answers_in_it_or_calls(client: openai.OpenAI) -> None:
    """tool_choice auto with response_format (an agent with tools and an output type): each output is calls with
    valid arguments or a JSON answer of the format, the same streamed and not (the random model calls: the answer
    branch is shown on the default model, test_structured_default_model.py)."""
    for seed in range(4):
        body = dict(messages=MESSAGES, tools=TOOLS, max_tokens=120, seed=seed, parallel_tool_calls=False,
                    response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})  # fmt: skip
        whole = client.chat.completions.create(model=MODEL, **body).choices[0]
        if whole.message.tool_calls:
            assert whole.finish_reason == "tool_calls" and not whole.message.content, whole
            for call in whole.message.tool_calls:
                schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
                jsonschema.validate(json.loads(call.function.arguments), schema)
        else:
            assert whole.finish_reason == "stop", whole
            jsonschema.validate(json.loads(whole.message.content), ANSWER)
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        content, streamed_calls_, finish = streamed_calls(client, **body)
        assert (content or None, streamed_calls_, finish) == (whole.message.content or None, calls, whole.finish_reason)


def test_structured_outputs_that_are_not_json_still_cannot_be_combined_with_tools(server: ThreadedServer) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "structured_outputs": {"regex": "[ab]+"}}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "structured_outputs", response.text


def test_a_null_parallel_tool_calls_is_the_default_true(server: ThreadedServer) -> None:
    """null is the default (true), as for every other field; read as false, it cut the answer to one call."""
    body = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0)
    counts = []
    for extra in ({}, {"parallel_tool_calls": None}):
        response = httpx.post(f"{server.base_url}/v1/chat/completions", json={**body, **extra}, timeout=60)
        assert response.status_code == 200, response.text
        counts.append(len(response.json()["choices"][0]["message"]["tool_calls"]))
    assert counts[1] == counts[0]
    assert counts[0] > 1 or server.family == "llama3"  # Hermes: a random model given parallel calls goes on calling
