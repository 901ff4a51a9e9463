"""With a reasoning parser, response_format's grammar shapes the answer only (tiny Qwen 3 through a real server):
the thought is free text up to </think>, then the JSON. Random weights write no thought of their own: logit_bias
opens one (<think>) and fills it with "h", and penalties on the repeated "h" soon leave </think> the likeliest."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.server_harness import ThreadedServer, llm_engine_loader, stream_request, tiny_engine_config
from tests.support.thought_model import END, H, MODEL, SCHEMA, START, schema_chat

def chat(**fields: Any) -> dict[str, Any]:
    return schema_chat({START: 100, H: 50, END: 45}, **fields)  # the bias on <think> opens the thought


def serve(tiny_qwen3_dir, **config: Any) -> ThreadedServer:
    return ThreadedServer(llm_engine_loader(tiny_engine_config(tiny_qwen3_dir, **config)), served_model_name=MODEL)


@pytest.fixture(scope="module")
def http(tiny_qwen3_dir) -> Iterator[httpx.Client]:
    with serve(tiny_qwen3_dir, reasoning_parser="qwen3") as server:
        assert server.engine.tokenizer.convert_ids_to_tokens([START, END, H]) == ["<think>", "</think>", "h"]
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            yield client


def is_answer(text: str | None) -> bool:
    value = json.loads(text or "null")
    return isinstance(value, dict) and set(value) == {"ok"} and isinstance(value["ok"], bool)


def test_the_thought_is_free_and_the_answer_after_it_matches_the_schema(http: httpx.Client) -> None:
    whole = http.post("/v1/chat/completions", json=chat()).json()
    choice = whole["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] and set(message["reasoning_content"]) == {"h"}, message
    assert is_answer(message["content"]) and choice["finish_reason"] == "stop", choice
    assert 0 < whole["usage"]["completion_tokens_details"]["reasoning_tokens"] < whole["usage"]["completion_tokens"]
    stream = stream_request(http, "/v1/chat/completions", chat(stream=True))
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in stream.events[:-1] if e["choices"])
    assert content == message["content"]


def test_a_prompt_that_closed_the_thought_gets_the_grammar_from_the_first_token(http: httpx.Client) -> None:
    body = chat(chat_template_kwargs={"enable_thinking": False})
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["reasoning_content"] is None and is_answer(message["content"]), message


def test_without_a_parser_the_grammar_holds_from_the_first_token(tiny_qwen3_dir) -> None:
    with serve(tiny_qwen3_dir) as server, httpx.Client(base_url=server.base_url, timeout=60) as http:
        message = http.post("/v1/chat/completions", json=chat()).json()["choices"][0]["message"]
        assert "reasoning_content" not in message and is_answer(message["content"]), message


def test_a_forced_tool_call_comes_after_the_thought(http: httpx.Client) -> None:
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": SCHEMA}}]
    body = chat(tools=tools, tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=100)
    del body["response_format"]
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] and set(message["reasoning_content"]) == {"h"}, message
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_time" and is_answer(call["function"]["arguments"]), call
    assert choice["finish_reason"] == "tool_calls"
