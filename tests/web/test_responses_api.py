"""/v1/responses through the official openai client, on a tiny model whose chat template has a tool format:
text and function calls, created whole and streamed (the SDK's own event parsing and accumulation), structured
output, continuation by previous_response_id, the store's GET / DELETE, and errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import orjson
import pytest
from openai.types.responses import ResponseFunctionToolCall, ResponseTextDeltaEvent

from web.responses_api.output import ResponseBuilder

from tests.support.responses_events import check_event_grammar
from tests.support.server_harness import ThreadedServer, llm_engine_loader, parse_sse, tiny_engine_config, wait_until
from tests.support.tool_model import MODEL, tiny_tool_model


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER}]
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
ANSWER_FORMAT = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_tool_model(tmp_path_factory.mktemp("tiny_tools"))


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ThreadedServer]:
    config = tiny_engine_config(model_dir, max_model_len=2048, num_kv_blocks=1024)
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(autouse=True)
def kv_returns_to_full(request) -> Iterator[None]:
    yield
    if "server" in request.fixturenames:
        engine = request.getfixturevalue("server").engine
        assert engine.num_free_blocks == engine.num_total_blocks


def raw_stream(server: ThreadedServer, body: dict, headers: dict | None = None) -> list[dict]:
    """The stream as sent: `event:` lines that name each data line's type, no [DONE]."""
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/responses", json={**body, "stream": True}, headers=headers) as response:
            assert response.status_code == 200, response.read()
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = list(response.iter_lines())
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    events, _ = parse_sse(line for line in lines if not line.startswith("event: "))
    assert "[DONE]" not in events and names == [e["type"] for e in events]
    return events


def test_text_whole_and_streamed_agree(server: ThreadedServer, client: openai.OpenAI) -> None:
    body = dict(model=MODEL, input="Hello world", instructions="Be brief.", max_output_tokens=12, temperature=0,
                metadata={"k": "v"}, user="u1")  # fmt: skip
    whole = client.responses.create(**body)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 12 and whole.usage.input_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + 12
    assert whole.metadata == {"k": "v"} and whole.user == "u1" and whole.instructions == "Be brief."
    assert whole.tool_choice == "auto" and whole.tools == []  # the API's defaults, as OpenAI echoes them
    (message,) = whole.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert message.content[0].type == "output_text" and whole.output_text == message.content[0].text != ""

    streamed = list(client.responses.create(**body, stream=True))
    deltas = [e.delta for e in streamed if isinstance(e, ResponseTextDeltaEvent)]
    assert "".join(deltas) == whole.output_text and deltas
    final = check_event_grammar([e.to_dict() for e in streamed])
    assert final["output"][0]["content"][0]["text"] == whole.output_text and final["usage"]["output_tokens"] == 12
    assert check_event_grammar(raw_stream(server, body))["status"] == "incomplete"


def test_json_schema_output_validates_streamed_by_the_sdk_helper(client: openai.OpenAI) -> None:
    body = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "Is it?"}]}],
                text=ANSWER_FORMAT, max_output_tokens=100, temperature=0)  # fmt: skip
    whole = client.responses.create(**body)
    assert whole.status == "completed" and whole.completed_at is not None
    jsonschema.validate(json.loads(whole.output_text), ANSWER)
    with client.responses.stream(**body) as stream:
        events = [event.to_dict(warnings=False) for event in stream]
        final = stream.get_final_response()
    check_event_grammar(events)
    assert final.output_text == whole.output_text and final.text.format.type == "json_schema"
    json_object = client.responses.create(**{**body, "text": {"format": {"type": "json_object"}}})
    assert json_object.status in ("completed", "incomplete")


def test_a_call_its_output_then_a_final_answer(client: openai.OpenAI, server: ThreadedServer) -> None:
    ask = dict(model=MODEL, input="Weather in Oslo?", tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
               max_output_tokens=200, temperature=0)  # fmt: skip
    first = client.responses.create(**ask)
    assert first.status == "completed", first
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and isinstance(calls[0], ResponseFunctionToolCall)
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    with client.responses.stream(**ask) as stream:
        events = [event.to_dict(warnings=False) for event in stream]
        streamed = stream.get_final_response()
    check_event_grammar(events)
    assert any(e["type"] == "response.function_call_arguments.delta" for e in events)
    (streamed_call,) = [item for item in streamed.output if item.type == "function_call"]
    assert (streamed_call.name, streamed_call.arguments) == (call.name, call.arguments)

    # The caller runs the function and sends its output back, with the call, as input items.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "-3 degrees"}
    answer = dict(model=MODEL, tools=TOOLS, tool_choice="none", text=ANSWER_FORMAT, max_output_tokens=100,
                  temperature=0)  # fmt: skip
    final = client.responses.create(**answer, input=[{"role": "user", "content": "Weather in Oslo?"}, call.to_dict(warnings=False), result])
    assert final.status == "completed" and [o.type for o in final.output] == ["message"]
    jsonschema.validate(json.loads(final.output_text), ANSWER)
    # The same through previous_response_id: the call comes from the store, only its output is sent.
    chained = client.responses.create(**answer, input=[result], previous_response_id=first.id)
    assert chained.output_text == final.output_text and chained.previous_response_id == first.id
    assert chained.usage.input_tokens_details.cached_tokens > 0
    rendered = prompt_of(server, [{"role": "user", "content": "x"}, call.to_dict(warnings=False), result])
    assert '<tool_call>\n{"name": "get_weather", "arguments": ' in rendered and "-3 degrees" in rendered


def test_auto_tools_stream_as_they_are_returned_whole(client: openai.OpenAI) -> None:
    body = dict(model=MODEL, input="Weather in Oslo?", tools=TOOLS, max_output_tokens=24, temperature=0)
    whole = client.responses.create(**body)
    assert whole.tool_choice == "auto" and whole.tools[0].name == "get_weather"
    events = [event.to_dict(warnings=False) for event in client.responses.create(**body, stream=True)]
    final = check_event_grammar(events)
    assert [(o["type"], o.get("arguments"), o.get("name")) for o in final["output"]] == \
        [(o.type, getattr(o, "arguments", None), getattr(o, "name", None)) for o in whole.output]  # fmt: skip
    assert final["status"] == whole.status


def test_auto_tools_with_a_text_format_call_or_answer_in_it(client: openai.OpenAI) -> None:
    """An agent with tools and an output type (openai-agents' output_type): calls, or a message in the format."""
    for question in range(3):
        body = dict(model=MODEL, input=f"Weather in Oslo? ({question})", tools=TOOLS, text=ANSWER_FORMAT,
                    max_output_tokens=150, parallel_tool_calls=False, temperature=0)  # fmt: skip
        whole = client.responses.create(**body)
        assert whole.status == "completed", whole
        for item in whole.output:
            if item.type == "function_call":
                jsonschema.validate(json.loads(item.arguments), WEATHER)
            else:
                jsonschema.validate(json.loads(whole.output_text), ANSWER)
        events = [event.to_dict(warnings=False) for event in client.responses.create(**body, stream=True)]
        final = check_event_grammar(events)
        assert [(o["type"], o.get("arguments")) for o in final["output"]] == \
            [(o.type, getattr(o, "arguments", None)) for o in whole.output]  # fmt: skip


def prompt_of(server: ThreadedServer, items: list[dict]) -> str:
    """The chat-template text a list of input items renders to (through the same conversion as /v1/responses)."""
    from web.responses_api.request import ResponsesRequest
    from web.responses_api.conversation import chat_messages

    messages = chat_messages(None, ResponsesRequest(model=MODEL, input=items).input_items())
    return server.engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_previous_response_id_continues_from_the_prefix_cache(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="The quick brown fox jumps over the lazy dog. " * 4,
                                    max_output_tokens=8, temperature=0)  # fmt: skip
    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)  # fmt: skip
    # The second prompt holds the first one and its answer: both were computed, so whole blocks come cached.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens - 16 and cached % 16 == 0
    third = client.responses.create(model=MODEL, input="More.", previous_response_id=second.id, max_output_tokens=4)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_stored_responses_get_and_delete(client: openai.OpenAI, server: ThreadedServer) -> None:
    created = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, temperature=0)
    fetched = client.responses.retrieve(created.id)
    assert fetched.to_dict() == created.to_dict()
    client.responses.delete(created.id)
    for call in (lambda: client.responses.retrieve(created.id), lambda: client.responses.delete(created.id)):
        with pytest.raises(openai.NotFoundError) as raised:
            call()
        assert raised.value.body["message"] == f"Response with id '{created.id}' not found."
    unstored = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(model=MODEL, input="x", previous_response_id=unstored.id)
    assert raised.value.body["param"] == "previous_response_id"
    assert raised.value.body["code"] == "previous_response_not_found"


BAD_BODIES = [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"tool_choice": {"type": "web_search_preview"}, "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # a past thought is taken and left out: no input
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "call_none", "output": "3"}]}, "input"),  # no such call
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]}, "input"),  # no output
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [1, 2]}, "input[0]"),
    ({"input": [{"role": "user", "content": "a"}] * 5000}, "input"),
    ({"temperature": 3}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 2047}, "max_output_tokens"),  # over the context with the prompt
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}}, "text.format.schema"),
    ({"input": "x" * 100_000}, "input"),
    ({"input": "日本語 " * 200_000}, "input"),  # 3.8 MB of JSON: longer than the context, not too many "items"
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), BAD_BODIES)
def test_what_cannot_be_done_is_a_400_naming_the_parameter(server: ThreadedServer, fields: dict, param: str) -> None:
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 4, **fields}
    for stream in (False, True):
        response = httpx.post(f"{server.base_url}/v1/responses", json={**body, "stream": stream}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, error


DEEP_SCHEMA = json.loads('{"anyOf": [' * 130 + '{"type": "string"}' + "]}" * 130)  # 261 levels of JSON


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": DEEP_SCHEMA}}, "tools": TOOLS,
          "tool_choice": "required"}, "text.format.schema"),  # calls only: the answer's format is never compiled
        ({"tools": [{**TOOLS[0], "parameters": DEEP_SCHEMA}], "tool_choice": "none"}, "tools[0].parameters"),
    ],
)  # fmt: skip
def test_a_schema_too_deep_to_repeat_in_the_response_is_a_400_where_it_is_not_compiled(
    server: ThreadedServer, fields: dict, param: str
) -> None:
    """The response repeats text.format and the tools: a schema that no grammar needed, nested deeper than orjson
    writes (254 levels), was a 500, and its stream was cut without a terminal event."""
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 4, **fields}
    for stream in (False, True):
        response = httpx.post(f"{server.base_url}/v1/responses", json={**body, "stream": stream}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and "nests" in error["message"], error


def test_a_failure_while_writing_the_stream_ends_it_with_an_error_event(
    server: ThreadedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug while writing an event (the tool-call parser's RecursionError on deep JSON was one) cut the connection:
    the client got no terminal event. The request is aborted and its KV freed (kv_returns_to_full)."""
    def broken(self: ResponseBuilder, text: str, token_ids: list[int] | None = None) -> list[dict]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(ResponseBuilder, "feed", broken)
    events = raw_stream(server, {"model": MODEL, "input": "Hello", "max_output_tokens": 4})
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"], events
    assert [e["sequence_number"] for e in events] == [0, 1, 2]
    assert events[-1]["code"] == "server_error" and "a bug" not in events[-1]["message"], events[-1]
    wait_until(lambda: server.engine.num_free_blocks == server.engine.num_total_blocks, timeout=30)


def test_an_input_too_long_for_the_context_is_named_as_the_input(server: ThreadedServer) -> None:
    for text in ("x" * 100_000, "word " * 5_000):  # over the characters' bound, then over the tokens'
        body = {"model": MODEL, "input": text, "max_output_tokens": 4}
        response = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "However, the input has " in error["message"], error
        assert error["code"] == "context_length_exceeded" and error["param"] == "input", error


@pytest.mark.parametrize("data", [b"", b"{", b"[1, 2]", b"null", b'"text"', b"\xff\xfe", b'{"model": 1}'])
def test_garbage_bodies_are_400s(server: ThreadedServer, data: bytes) -> None:
    response = httpx.post(f"{server.base_url}/v1/responses", content=data, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"], response.text


def test_unknown_model_and_ids_are_404s(server: ThreadedServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        response = http.post("/v1/responses", json={"model": "other", "input": "x"})
        assert response.status_code == 404 and response.json()["error"]["param"] == "model"
        for method in ("GET", "DELETE"):
            response = http.request(method, "/v1/responses/resp_nope")
            assert response.status_code == 404
            assert response.json() == {"error": {"message": "Response with id 'resp_nope' not found.",
                                                 "type": "invalid_request_error", "param": None, "code": None}}
        # a long name or id (200 KB, 8 KB) is named, not sent back whole
        for response in (http.post("/v1/responses", json={"model": "m" * 200_000, "input": "x"}),
                         http.get(f"/v1/responses/resp_{'x' * 8_000}")):  # fmt: skip
            message = response.json()["error"]["message"]
            assert response.status_code == 404 and len(message) == 1000 and message.endswith("…"), len(message)


def test_a_stored_responses_input_items_are_listed(client: openai.OpenAI, server: ThreadedServer) -> None:
    """GET /v1/responses/{id}/input_items (the SDK's responses.input_items.list): what the response was made from,
    a continuation's included, newest first by default, in pages that `after` continues."""
    first = client.responses.create(model=MODEL, input=[{"role": "system", "content": "Be brief"},
                                    {"role": "user", "content": "Hi there, how are you?"}], max_output_tokens=4,
                                    temperature=0)  # fmt: skip
    assert [item.type for item in first.output] == ["message"]  # (greedy: sampled, an output may end at once)
    second = client.responses.create(model=MODEL, input="Again?", previous_response_id=first.id, max_output_tokens=4)
    page = client.responses.input_items.list(second.id)
    assert [(item.type, item.role) for item in page.data] == \
        [("message", "user"), ("message", "assistant"), ("message", "user"), ("message", "system")]  # fmt: skip
    assert page.data[0].content[0].text == "Again?" and page.data[2].content[0].text == "Hi there, how are you?"
    assert page.data[1].content[0].type == "output_text" and page.data[1].content[0].text == first.output_text
    assert not page.has_more and page.first_id == page.data[0].id and len({item.id for item in page.data}) == 4
    # An item keeps its id from response to response: the output message is listed under its own id.
    first_page = client.responses.input_items.list(first.id)
    assert [item.id for item in first_page.data] == [item.id for item in page.data[2:]]
    assert page.data[1].id == first.output[0].id
    mine = client.responses.create(model=MODEL, input=[{"id": "msg_mine", "role": "user", "content": "x"}],
                                   max_output_tokens=2)  # fmt: skip
    assert [item.id for item in client.responses.input_items.list(mine.id).data] == ["msg_mine"]
    paged = client.responses.input_items.list(second.id, order="asc", limit=3)
    assert [item.id for item in paged.data] == [item.id for item in reversed(page.data)][:3] and paged.has_more
    assert [item.id for item in paged] == [item.id for item in reversed(page.data)]  # the SDK follows `after`
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        for query, param in [("limit=0", "limit"), ("limit=x", "limit"), ("order=up", "order"), ("after=msg_x", "after")]:
            response = http.get(f"/v1/responses/{second.id}/input_items?{query}")
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        assert http.get("/v1/responses/resp_nope/input_items").status_code == 404


def test_cjk_and_emoji_round_trip(client: openai.OpenAI) -> None:
    text = "日本語のテキストと中文文本和한국어 텍스트. Emoji: 😀 🚀 🎉 👍🏽 ❤️"
    first = client.responses.create(model=MODEL, input=text, max_output_tokens=16, temperature=0)
    assert first.output_text.encode("utf-8").decode("utf-8") == first.output_text
    stored = orjson.loads(httpx.get(f"{client.base_url}responses/{first.id}").content)
    assert stored["output"][0]["content"][0]["text"] == first.output_text
    again = client.responses.create(model=MODEL, input="🎉", previous_response_id=first.id, max_output_tokens=4)
    assert again.usage.input_tokens_details.cached_tokens > 0


def test_a_response_opts_out_of_speculation_as_chat_does() -> None:
    """"speculative": false was dropped as an unknown field, so the request speculated anyway."""
    from web.responses_api.request import parse_responses_request

    def speculates(**fields: object) -> bool:
        return parse_responses_request({"model": MODEL, "input": "hi", **fields}).to_sampling_params().speculative

    assert (speculates(), speculates(speculative=True), speculates(speculative=False)) == (True, True, False)
    with pytest.raises(Exception, match="speculative: Input should be a valid boolean"):
        speculates(speculative="no")


def test_an_assistant_refusal_part_in_the_input_is_read_as_its_text(client: openai.OpenAI) -> None:
    """A response's output message holds output_text or refusal parts (OpenAI's): a client that sends the output
    back as input (its conversation so far) may send a refusal. It was a 400 ("content of type 'refusal'")."""
    def input_tokens(part: dict) -> int:
        conversation = [{"role": "user", "content": "hi"}, {"type": "message", "role": "assistant", "content": [part]},
                        {"role": "user", "content": "why?"}]  # fmt: skip
        return client.responses.create(model=MODEL, input=conversation, max_output_tokens=1).usage.input_tokens

    refused = input_tokens({"type": "refusal", "refusal": "I can't help with that."})
    assert refused == input_tokens({"type": "output_text", "text": "I can't help with that.", "annotations": []})
    assert refused > input_tokens({"type": "output_text", "text": "No.", "annotations": []})


@pytest.mark.parametrize(
    ("raw_fields", "message"),
    [
        ('"input": null', "input: Input should be a valid string or a valid list"),  # not "a valid string" alone
        ('"input": "Hello", "max_output_tokens": 1180591620717411303424',  # 2**70: a valid integer, too large
         "max_output_tokens: Input should be an integer within 64 bits"),
    ],
)
def test_a_value_of_the_wrong_type_is_described_as_the_chat_endpoint_describes_it(
    server: ThreadedServer, raw_fields: str, message: str
) -> None:
    body = '{"model": "%s", %s}' % (MODEL, raw_fields)
    response = httpx.post(f"{server.base_url}/v1/responses", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"] == message, response.text


def test_cancel_is_refused_as_openai_refuses_a_response_not_made_in_the_background(client: openai.OpenAI) -> None:
    """The SDK's responses.cancel (POST /v1/responses/{id}/cancel): OpenAI cancels background responses only, and
    this server makes none; a stored response gets that 400, an unknown id the store's 404 (not an unknown route)."""
    created = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.cancel(created.id)
    assert "background" in raised.value.body["message"]
    assert client.responses.retrieve(created.id).status == created.status  # left as it was
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.cancel("resp_nope")
    assert raised.value.body["message"] == "Response with id 'resp_nope' not found."


def test_null_store_and_parallel_tool_calls_mean_their_defaults(server: ThreadedServer) -> None:
    """JSON null for a field is its default, as for every other field: store (true) keeps the response, and
    parallel_tool_calls (true) is echoed true; null read as false lost the response for previous_response_id."""
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 2, "store": None, "parallel_tool_calls": None}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        created = http.post("/v1/responses", json=body).json()
        assert created["store"] is True and created["parallel_tool_calls"] is True
        assert http.get(f"/v1/responses/{created['id']}").status_code == 200
