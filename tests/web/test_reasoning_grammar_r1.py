"""deepseek_r1 with a grammar after its thought (tiny Qwen 3 through a real server): the output is a thought from its
first token, so no <think> is needed; logit_bias fills it with "h" and penalties soon leave </think> the likeliest,
then the JSON schema holds. Every surface that meets the thought: chat (whole, streamed, n choices, logprobs, cut by
max_tokens, left by its client), the Responses API, and speculation."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.responses_events import check_event_grammar
from tests.support.server_harness import (ThreadedServer, llm_engine_loader, slowed, stream_request, tiny_engine_config,
                                         wait_until, wrapped_execute)  # fmt: skip
from tests.support.thought_model import END, H, MODEL, SCHEMA, START, schema_chat

def chat(**fields: Any) -> dict[str, Any]:
    return schema_chat({H: 50, END: 45}, **fields)  # deepseek_r1's output is a thought from its first token


def serve(tiny_qwen3_dir, **config: Any) -> ThreadedServer:
    config = tiny_engine_config(tiny_qwen3_dir, reasoning_parser="deepseek_r1", **config)
    return ThreadedServer(llm_engine_loader(config), served_model_name=MODEL)


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir) -> Iterator[ThreadedServer]:
    with serve(tiny_qwen3_dir) as server:
        assert server.engine.tokenizer.convert_ids_to_tokens([START, END, H]) == ["<think>", "</think>", "h"]
        yield server


@pytest.fixture(scope="module")
def http(server: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def is_answer(text: str | None) -> bool:
    value = json.loads(text or "null")
    return isinstance(value, dict) and set(value) == {"ok"} and isinstance(value["ok"], bool)


def joined(events: list[dict[str, Any]], key: str, index: int = 0) -> str | None:
    """A choice's streamed deltas of one field, joined; None where no delta had any."""
    pieces = [c["delta"][key] for e in events for c in e["choices"] if c["index"] == index and c["delta"].get(key)]
    return "".join(pieces) if pieces else None


def test_the_answer_after_a_thought_from_the_first_token_matches_the_schema(http: httpx.Client) -> None:
    choice = http.post("/v1/chat/completions", json=chat()).json()["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] and set(message["reasoning_content"]) == {"h"}, message
    assert is_answer(message["content"]) and choice["finish_reason"] == "stop", choice
    events = stream_request(http, "/v1/chat/completions", chat()).events[:-1]
    assert joined(events, "reasoning_content") == message["reasoning_content"]
    assert joined(events, "content") == message["content"]


def test_n_choices_each_think_then_answer_and_logprobs_cover_every_token(http: httpx.Client) -> None:
    """Each choice's grammar is its own (a choice still thinking beside one answering); logprobs are one per
    generated token, thought and markers included, as vLLM's."""
    body = chat(n=3, temperature=1.0, seed=3, logprobs=True, top_logprobs=2)
    whole = http.post("/v1/chat/completions", json=body).json()
    events = stream_request(http, "/v1/chat/completions", body).events[:-1]
    for choice in whole["choices"]:
        message = choice["message"]
        assert message["reasoning_content"] and is_answer(message["content"]), choice
        assert joined(events, "reasoning_content", choice["index"]) == message["reasoning_content"]
        assert joined(events, "content", choice["index"]) == message["content"]
    assert sum(len(c["logprobs"]["content"]) for c in whole["choices"]) == whole["usage"]["completion_tokens"]


def test_max_tokens_inside_the_thought_is_length_with_the_thought_and_no_content(http: httpx.Client) -> None:
    whole = http.post("/v1/chat/completions", json=chat(max_tokens=3)).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None, choice
    assert choice["message"]["reasoning_content"] == "hhh"
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3
    events = stream_request(http, "/v1/chat/completions", chat(max_tokens=3)).events[:-1]
    assert (joined(events, "reasoning_content"), joined(events, "content")) == ("hhh", None)
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]


def test_a_client_that_leaves_mid_thought_frees_its_kv(server: ThreadedServer, http: httpx.Client) -> None:
    engine = server.engine
    body = chat(max_tokens=300, logit_bias={str(H): 30}, stream=True)  # a thought that does not end soon
    with wrapped_execute(engine, slowed(0.02)):
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if '"reasoning_content"' in line:
                    break
            assert engine.num_running == 1 and engine.num_free_blocks < engine.num_total_blocks
        wait_until(lambda: engine.num_running == 0 and engine.num_free_blocks == engine.num_total_blocks, 10)


def thought_scripted(script: list[int]) -> Callable[[Callable], Callable]:
    """A forward pass whose first sampled tokens are the script's (the Responses API has no logit_bias to make a
    thought with); the answer after them is sampled under the grammar."""

    def wrap(execute: Callable) -> Callable:
        def scripted_execute(plan: Any) -> Any:
            output = execute(plan)
            for chunk, token in zip([c for c in plan.chunks if c.is_sampling], output.sampled):
                if chunk.seq.num_output_tokens < len(script):
                    token.token_id = script[chunk.seq.num_output_tokens]
            return output

        return scripted_execute

    return wrap


def responses_of(server: ThreadedServer, thought: str, max_output_tokens: int) -> tuple[dict, list[dict]]:
    """A Responses API request for SCHEMA's JSON after the scripted thought, whole and streamed (its events)."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    body = {"model": MODEL, "input": "Hello world", "max_output_tokens": max_output_tokens, "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}}}  # fmt: skip
    with wrapped_execute(server.engine, thought_scripted([*server.engine.tokenizer.encode(thought), END])):
        whole = client.responses.create(**body).model_dump()
        return whole, [event.model_dump() for event in client.responses.create(**body, stream=True)]


def test_the_responses_api_gives_the_reasoning_item_then_a_message_of_the_schema(server: ThreadedServer) -> None:
    whole, events = responses_of(server, "\nab", max_output_tokens=40)
    reasoning, message = whole["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "\nab"}]
    assert message["type"] == "message" and is_answer(message["content"][0]["text"]), message
    assert whole["status"] == "completed"
    final = check_event_grammar(events)
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert [o["content"] for o in final["output"]] == [reasoning["content"], message["content"]]


def test_the_responses_api_cut_inside_the_thought_is_incomplete_with_the_reasoning_item_only(
    server: ThreadedServer,
) -> None:
    tokenizer = server.engine.tokenizer
    whole, events = responses_of(server, "\nabcdef", max_output_tokens=3)
    for response in (whole, check_event_grammar(events)):
        assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
        [reasoning] = response["output"]
        assert reasoning["type"] == "reasoning" and reasoning["status"] == "incomplete", reasoning
        assert reasoning["content"][0]["text"] == tokenizer.decode(tokenizer.encode("\nabcdef")[:3])


def accepted_tokens(http: httpx.Client) -> float:
    metrics = http.get("/metrics").text
    found = re.findall(r"^sluice_speculative_accepted_tokens_total\{[^}]*\} ([0-9.e+]+)$", metrics, re.M)
    return sum(map(float, found))


def test_speculation_through_the_thought_and_the_grammar_changes_no_token(tiny_qwen3_dir, http: httpx.Client) -> None:
    """A thought of repeated "h" is what n-gram drafts are made of; drafts across </think> meet the grammar."""
    body = chat(max_tokens=60, presence_penalty=0, frequency_penalty=0.3)
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert len(plain["message"]["reasoning_content"]) > 10 and is_answer(plain["message"]["content"]), plain
    with serve(tiny_qwen3_dir, speculative="on") as fast, httpx.Client(base_url=fast.base_url, timeout=60) as client:
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        events = stream_request(client, "/v1/chat/completions", body).events[:-1]
        assert accepted_tokens(client) > 0
    assert whole == plain
    assert (joined(events, "reasoning_content"), joined(events, "content")) == (
        plain["message"]["reasoning_content"], plain["message"]["content"])  # fmt: skip


def test_a_completion_prompt_opens_no_thought_so_its_grammar_holds_from_the_first_token(http: httpx.Client) -> None:
    """/v1/completions splits nothing (vLLM's): its text is raw, markers and all. deepseek_r1's thought from the first
    token is its chat templates' rule; a plain prompt has a thought only where the prompt or the output opens one,
    else a grammar waited for a </think> no plain completion writes (free text up to max_tokens, never the JSON)."""
    body = {k: v for k, v in chat().items() if k != "messages"}
    for prompt, is_thought in (("Answer in JSON:", False), ("Answer in JSON: <think>", True)):
        choice = http.post("/v1/completions", json={**body, "prompt": prompt}).json()["choices"][0]
        thought, _, answer = choice["text"].rpartition("</think>")
        assert is_answer(answer) and choice["finish_reason"] == "stop", (prompt, choice)
        assert bool(thought) is is_thought and "<think>" not in choice["text"], (prompt, choice)
        events = stream_request(http, "/v1/completions", {**body, "prompt": prompt}).events[:-1]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == choice["text"]
