"""The OpenAI API of a real Hypercorn server (tiny model): stream format, parity, usage, logprobs, bad input."""

from __future__ import annotations

import contextlib
import gzip
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import orjson
from prometheus_client.parser import text_string_to_metric_families
import pytest

from web.responses import ChatResponses, CompletionResponses

from tests.support.lifecycle import engine_idle
from tests.support.server_harness import (ThreadedServer, health, llm_engine_loader, slowed, stream_request,
                                         tiny_engine_config, wait_until, wrapped_execute)


MODEL = "tiny"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 12, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> Iterator[ThreadedServer]:
    config = tiny_engine_config(tiny_llama_dir)
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL, max_body_bytes=64 * 1024) as server:
        yield server


@pytest.fixture(scope="module")
def http(server: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def streamed_text(events: list[Any], key: str) -> str:
    if key == "delta":
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])


def test_chat_stream_format_is_exactly_openai(http: httpx.Client) -> None:
    body = {**CHAT, "stream_options": {"include_usage": True}}
    result = stream_request(http, "/v1/chat/completions", body)
    assert result.status == 200
    assert result.headers["content-type"].startswith("text/event-stream")
    assert result.headers["cache-control"] == "no-cache" and result.headers["x-accel-buffering"] == "no"
    events = result.events
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *content, finish, usage = chunks[1:]
    for chunk in content:
        assert set(chunk["choices"][0]["delta"]) == {"content"} and chunk["choices"][0]["finish_reason"] is None
        assert chunk["usage"] is None
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 12
    # raw SSE framing: "data: {json}" lines separated by blank lines
    assert all(line.startswith("data: ") for line in result.raw_lines[::2])
    assert all(line == "" for line in result.raw_lines[1::2])


def test_continuous_usage_stats_put_the_tokens_so_far_in_every_chunk(http: httpx.Client) -> None:
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens its choice has so far
    (the logprobs of the chunks up to it), the usage chunk the whole; only with include_usage."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {**CHAT, "logprobs": True, "stream_options": options}
    chunks = stream_request(http, "/v1/chat/completions", body).events[:-1]
    *chunks, total = chunks
    assert total["choices"] == [] and total["usage"]["completion_tokens"] == 12
    prompt_tokens = total["usage"]["prompt_tokens"]
    num_tokens = 0
    for chunk in chunks:
        num_tokens += len((chunk["choices"][0]["logprobs"] or {}).get("content") or [])
        assert chunk["usage"]["prompt_tokens"] == prompt_tokens and chunk["usage"]["completion_tokens"] == num_tokens
        assert chunk["usage"]["total_tokens"] == prompt_tokens + num_tokens
    assert chunks[0]["usage"]["completion_tokens"] == 0 and chunks[-1]["usage"]["completion_tokens"] == 12
    completion = {**COMPLETION, "stream": True, "stream_options": options}
    chunks = stream_request(http, "/v1/completions", completion).events[:-1]
    assert [c["usage"]["completion_tokens"] for c in chunks][-2:] == [12, 12]  # the finish chunk, then the total
    without_usage = {**completion, "stream_options": {"continuous_usage_stats": True}}
    assert all("usage" not in c for c in stream_request(http, "/v1/completions", without_usage).events[:-1])


def test_completion_stream_format(http: httpx.Client) -> None:
    result = stream_request(http, "/v1/completions", COMPLETION)
    chunks = result.events[:-1]
    assert result.events[-1] == "[DONE]" and len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length",
                                        "stop_reason": None}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_streamed_equals_non_streamed_with_the_openai_client(client: openai.OpenAI) -> None:
    messages = CHAT["messages"]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(pieces) == whole.choices[0].message.content
    assert whole.usage.completion_tokens == 16 and whole.choices[0].finish_reason == "length"

    text = client.completions.create(model=MODEL, prompt="Paged attention", max_tokens=16, temperature=0)
    streamed = client.completions.create(
        model=MODEL, prompt="Paged attention", max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text


def test_sixteen_concurrent_streams_each_equal_their_result_alone(http: httpx.Client) -> None:
    prompts = [f"Request number {i}: the quick brown fox" for i in range(16)]
    bodies = [{**COMPLETION, "prompt": p, "max_tokens": 10 + i % 5} for i, p in enumerate(prompts)]
    alone = [http.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]
    with ThreadPoolExecutor(16) as pool:
        streams = list(pool.map(lambda b: stream_request(http, "/v1/completions", b), bodies))
    for result, expected in zip(streams, alone):
        assert streamed_text(result.events, "text") == expected


def test_usage_counts_are_exact(server: ThreadedServer, http: httpx.Client) -> None:
    engine = server.engine
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    body = {**CHAT, "messages": messages, "max_tokens": 7, "ignore_eos": True}
    usage = http.post("/v1/chat/completions", json=body).json()["usage"]
    prompt_tokens = len(engine.input_processor.encode_chat(messages))
    assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == 7
    assert usage["total_tokens"] == prompt_tokens + 7
    usage = http.post("/v1/completions", json={**COMPLETION, "prompt": [5, 6, 7, 8], "max_tokens": 3}).json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (4, 3, 7)


def test_stop_reason_names_the_stop_string_or_token_as_vllm_does(http: httpx.Client) -> None:
    body = {**COMPLETION, "max_tokens": 16, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    assert whole["finish_reason"] == "length" and whole["stop_reason"] is None
    stop = next(c for c in whole["text"][2:] if c.isalnum())
    for path, fields in (("/v1/completions", {**body, "stop": [stop]}), ("/v1/chat/completions", {**CHAT, "stop": stop})):
        choice = http.post(path, json=fields).json()["choices"][0]
        events = stream_request(http, path, fields).events
        (finish,) = [c["choices"][0] for c in events[:-1] if c["choices"] and c["choices"][0]["finish_reason"]]
        if choice["finish_reason"] == "stop":  # chat's text is another: it may end by EOS (stop_reason None)
            assert choice["stop_reason"] in (stop, None) and finish["stop_reason"] == choice["stop_reason"]
    choice = http.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop


def test_the_final_message_can_be_continued(server: ThreadedServer, http: httpx.Client) -> None:
    """vLLM's continue_final_message: the template leaves the assistant's last words open, no new turn."""
    messages = [{"role": "user", "content": "Count to ten."}, {"role": "assistant", "content": "1, 2, 3,"}]
    switches = [{}, {"add_generation_prompt": False}, {"continue_final_message": True}]
    prompts = [server.engine.input_processor.encode_chat(messages, add_generation_prompt=True),
               server.engine.input_processor.encode_chat(messages, add_generation_prompt=False),
               server.engine.input_processor.encode_chat(messages, add_generation_prompt=False,
                                                         continue_final_message=True)]  # fmt: skip
    assert len({len(p) for p in prompts}) == 3
    for fields, prompt in zip(switches, prompts):
        body = {**CHAT, "messages": messages, "max_tokens": 2, **fields}
        assert http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"] == len(prompt)
        assert http.post("/tokenize", json={"messages": messages, **fields}).json()["tokens"] == prompt
    response = http.post("/v1/chat/completions", json={**CHAT, "continue_final_message": "yes"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_asking_both_to_continue_the_final_message_and_to_open_a_new_turn_is_refused(
    http: httpx.Client, path: str
) -> None:
    """vLLM refuses both switches sent true (the generation prompt is the default, so only when sent): continuing
    silently won over the generation prompt the request asked for."""
    messages = [{"role": "user", "content": "Count to ten."}, {"role": "assistant", "content": "1, 2, 3,"}]
    body = {**CHAT, "messages": messages, "max_tokens": 2, "continue_final_message": True}
    assert http.post(path, json=body).status_code == 200
    response = http.post(path, json={**body, "add_generation_prompt": True})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "continue_final_message" and "add_generation_prompt" in error["message"], error


def test_chat_template_kwargs_reach_the_template(server: ThreadedServer, http: httpx.Client) -> None:
    """vLLM's chat_template_kwargs: more variables for the template (here Qwen 3's enable_thinking switch)."""
    messages = CHAT["messages"]
    plain = server.engine.input_processor.encode_chat(messages)
    no_thinking = server.engine.input_processor.encode_chat(messages, enable_thinking=False)
    assert len(no_thinking) > len(plain)
    for variables, prompt in [({"enable_thinking": True}, plain), ({"enable_thinking": False}, no_thinking)]:
        body = {**CHAT, "max_tokens": 2, "chat_template_kwargs": variables}
        assert http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"] == len(prompt)
        assert http.post("/tokenize", json={"messages": messages, "chat_template_kwargs": variables}).json()[
            "tokens"] == prompt  # fmt: skip
    for variables in [{"tokenize": False}, {"add_generation_prompt": False}, {"not a name": 1}, ["enable_thinking"]]:
        response = http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": variables})
        assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template_kwargs", variables

def test_logprobs_shapes(http: httpx.Client) -> None:
    chat = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 3}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert isinstance(entry["bytes"], list) and entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][-1]["logprob"]
    completion = http.post("/v1/completions", json={**COMPLETION, "max_tokens": 4, "logprobs": 2}).json()
    logprobs = completion["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 4
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    for logprobs_n in (0, 2):  # the sampled token is always among the top ones (OpenAI: up to logprobs + 1)
        body = {**COMPLETION, "max_tokens": 6, "logprobs": logprobs_n, "temperature": 1.5, "seed": 3}
        logprobs = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
        for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
            assert top[token] == logprob and logprobs_n <= len(top) <= logprobs_n + 1
    streamed = stream_request(http, "/v1/chat/completions", {**CHAT, "max_tokens": 4, "logprobs": True})
    entries = [e for c in streamed.events[:-1] for e in ((c["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert [e["token"] for e in entries] == [e["token"] for e in content]


def test_models_and_health(http: httpx.Client, server: ThreadedServer) -> None:
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == server.engine.max_model_len and models["data"][0]["root"] == MODEL
    assert time.time() - 3600 < models["data"][0]["created"] <= time.time()  # when the server started
    health = http.get("/health")
    assert health.status_code == 200
    assert set(health.json()) == {"state", "waiting", "running", "pending", "free_kv_blocks", "total_kv_blocks"}
    metrics = http.get("/metrics").text
    for name in ("sluice_admission_seconds_bucket", "sluice_time_to_first_token_seconds_count"):
        assert name in metrics
    assert "sluice_requests_rejected_total" in metrics and "sluice_prefix_cache_hit_rate" in metrics

    def token_counts() -> tuple[float, float]:
        families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
        return tuple(families[name].samples[0].value for name in ("sluice_prompt_tokens", "sluice_generation_tokens"))

    before = token_counts()
    usage = http.post("/v1/completions", json={**COMPLETION, "n": 2, "ignore_eos": True}).json()["usage"]
    stream_request(http, "/v1/completions", {**COMPLETION, "ignore_eos": True})
    after = token_counts()
    assert after[0] - before[0] == 2 * usage["prompt_tokens"] and after[1] - before[1] == usage["completion_tokens"] + 12


def test_a_request_may_leave_the_model_out_as_vllm_allows(http: httpx.Client) -> None:
    """curl users of a one-model server send no model (vLLM and llama.cpp's server take that); a wrong one is 404."""
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        unnamed = {k: v for k, v in body.items() if k != "model"}
        answer = http.post(path, json=unnamed)
        assert answer.status_code == 200 and answer.json()["model"] == MODEL
        assert answer.json()["choices"][0] == http.post(path, json=body).json()["choices"][0]
        stream = stream_request(http, path, {**unnamed, "model": None})
        chunks = [event for event in stream.events if event != "[DONE]"]
        assert stream.status == 200 and chunks and all(chunk["model"] == MODEL for chunk in chunks)
        wrong = http.post(path, json={**body, "model": "gpt-4o"})
        assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    response = http.post("/v1/responses", json={"input": "Hello world", "max_output_tokens": 8})
    assert response.status_code == 200 and response.json()["model"] == MODEL

def test_stop_and_sampling_parameters_are_accepted(client: openai.OpenAI, http: httpx.Client) -> None:
    result = client.chat.completions.create(
        model=MODEL, messages=CHAT["messages"], max_completion_tokens=8, temperature=0.8, top_p=0.9, seed=7,
        presence_penalty=0.5, frequency_penalty=0.5, stop=["\n", "zz"],
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True},
    )  # fmt: skip
    assert result.usage.completion_tokens >= 2
    seeded = {**COMPLETION, "temperature": 1.0, "seed": 1234}
    first, second = (http.post("/v1/completions", json=seeded).json()["choices"][0]["text"] for _ in range(2))
    assert first == second


BAD_REQUESTS = [
    # (path, body or raw bytes, content type, status, param or None, words in the message)
    ("/v1/chat/completions", {**CHAT, "messages": []}, None, 400, "messages", "at least 1"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "bot", "content": "x"}]}, None, 400, "messages.0.role", ""),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "5"}, None, 400, "max_tokens", "integer"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, None, 400, "max_tokens", ""),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, None, 400, "temperature", ""),
    ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, None, 400, "top_p", ""),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 50, "logprobs": True}, None, 400, "top_logprobs", ""),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, None, 400, "stream", ""),
    ("/v1/chat/completions", {**CHAT, "n": 0}, None, 400, "n", "n must be"),
    ("/v1/chat/completions", {**CHAT, "n": 17}, None, 400, "n", "max_num_seqs (16)"),
    ("/v1/completions", {**COMPLETION, "n": 2, "echo": True, "logprobs": 1}, None, 400, "n", "n=1"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"99999": 5}}, None, 400, "logit_bias", "99999"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"7": 101}}, None, 400, "logit_bias", "[-100, 100]"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"x7": 1}}, None, 400, "logit_bias", "token ids"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"7": "1"}}, None, 400, "logit_bias", ""),
    ("/v1/completions", {**COMPLETION, "logit_bias": {str(i): 1 for i in range(301)}}, None, 400, "logit_bias", "300"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, None, 400, "tools.0.function", "required"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "structured_outputs": {"choice": ["a", "b"]}},
     None, 400, "structured_outputs", "tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "structured_outputs": {"json": "{oops"}},
     None, 400, "structured_outputs.json", "not JSON"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "structured_outputs": {"json": "[1]"}},
     None, 400, "structured_outputs.json", "JSON schema"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, None, 400, "tool_choice", "needs tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     None, 400, "tool_choice", "nope"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
     "tool_choice": "required"}, None, 400, "tools", "the parameters of tool 'f' are not a usable JSON schema"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, None, 400, "functions", "tools"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x",
     "schema": {"type": "nope"}}}}, None, 400, "response_format", "cannot be compiled"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, None, 400, "response_format", "schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, None, 400, "response_format.type", ""),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}, "min_tokens": 2}, None, 400,
     "min_tokens", "structured"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "a(b"}}, None, 400, "structured_outputs.regex",
     "unclosed group"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"grammar": "start: nothing_here"}}, None, 400,
     "structured_outputs.grammar", "nothing_here"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "a", "choice": ["a"]}}, None, 400,
     "structured_outputs", "exactly one"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"json": {"type": "object"}},
     "response_format": {"type": "json_object"}}, None, 400, "structured_outputs", "either"),
    ("/v1/completions", {**COMPLETION, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 1}}}},
     None, 400, "response_format", "cannot be compiled"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"json": "{oops"}}, None, 400, "structured_outputs.json", ""),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 600}, None, 400, "max_tokens", "512"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 600}, None, 400, "max_completion_tokens",
     "600 in max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, None, 404, "model", "gpt-4"),
    ("/v1/chat/completions", {k: v for k, v in CHAT.items() if k != "messages"}, None, 400, "messages", "required"),
    ("/v1/completions", {**COMPLETION, "prompt": ""}, None, 400, "prompt", "empty"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 99999]}, None, 400, "prompt", "99999"),
    ("/v1/completions", {**COMPLETION, "echo": True, "stream": True}, None, 400, "echo", "without stream"),
    ("/v1/completions", {**COMPLETION, "best_of": 3}, None, 400, "best_of", ""),
    ("/v1/completions", {**COMPLETION, "min_tokens": 20, "max_tokens": 5}, None, 400, "min_tokens", "max_tokens"),
    ("/v1/completions", {**COMPLETION, "prompt": "x" * 300, "max_tokens": 400}, None, 400, "max_tokens", "512"),
    ("/v1/completions", b"{not json", "application/json", 400, None, "JSON"),
    ("/v1/completions", b"[1, 2]", "application/json", 400, None, "object"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', "application/json", 400, None,
     "not valid JSON: it is not UTF-8 (byte 29 is 0xff)"),
    ("/v1/completions", b"prompt=hi", "application/x-www-form-urlencoded", 415, None, "application/json"),
    ("/v1/completions", b"x" * (65 * 1024), "application/json", 413, None, ""),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, None, 400, "messages.0.content",
     "a valid string or a valid list"),
]


def test_a_compressed_body_and_a_chunked_body_over_the_limit_are_named(http: httpx.Client) -> None:
    """A gzip body was parsed as JSON text ("not valid UTF-8: surrogates not allowed"); a chunked one over the limit got
    Quart's "exceeds the capacity limit" where a declared one gets the limit named."""
    body = gzip.compress(orjson.dumps(COMPLETION))
    response = http.post("/v1/completions", content=body,
                         headers={"content-type": "application/json", "content-encoding": "gzip"})  # fmt: skip
    assert response.status_code == 415, response.text
    assert "content-encoding 'gzip' is not supported" in response.json()["error"]["message"]
    chunks = (b"x" * 8192 for _ in range(10))  # no Content-Length: sent chunked
    response = http.post("/v1/completions", content=chunks, headers={"content-type": "application/json"})
    assert response.status_code == 413, response.text
    assert response.json()["error"]["message"].endswith("bytes (max_body_bytes)")


@pytest.mark.parametrize("path,body,content_type,status,param,words", BAD_REQUESTS)
def test_bad_input_gets_an_openai_error(
    http: httpx.Client, path: str, body: Any, content_type: str | None, status: int, param: str | None, words: str
) -> None:
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": content_type or "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert words.lower() in error["message"].lower()


def test_an_error_answered_before_the_body_arrives_keeps_the_connection(server: ThreadedServer) -> None:
    """A 415 is decided from the headers alone. Sent before the body has arrived, it must not close the connection
    under the client (which then loses its next request on it): the server reads the body first. The body goes
    out only after the 415 is in, as a busy client's second write can."""
    with socket.create_connection(("127.0.0.1", server.config.port), timeout=30) as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: text/plain\r\nContent-Length: 9\r\n\r\n"
        sock.sendall(head)
        sock.settimeout(0.5)
        early = b""
        with contextlib.suppress(TimeoutError):
            early = sock.recv(65536)  # the old behaviour: the 415 at once, then the connection closed
        sock.settimeout(30)
        sock.sendall(b"prompt=hi")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        replies = early
        while replies.count(b"HTTP/1.1 ") < 2:
            chunk = sock.recv(65536)
            assert chunk, f"the server closed the connection after: {replies[:200]!r}"
            replies += chunk
    assert replies.startswith(b"HTTP/1.1 415 ") and b"HTTP/1.1 200 " in replies


@pytest.mark.parametrize("method,path,status", [("GET", "/nowhere", 404), ("GET", "/v1/completions", 405)])
def test_unknown_routes_and_methods(http: httpx.Client, method: str, path: str, status: int) -> None:
    response = http.request(method, path)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_the_openai_client_sees_errors_as_api_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT["messages"])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=100000)


@pytest.mark.parametrize("fields", [
    {"messages": [{"role": "user", "content": "word " * 5_000}]},  # over the context in tokens
    {"messages": [{"role": "user", "content": "x" * 60_000}]},  # in characters, before the template
    {"messages": CHAT["messages"], "max_tokens": 100_000},  # with the output
    {"messages": CHAT["messages"], "max_completion_tokens": 100_000},
])  # fmt: skip
def test_a_request_over_the_context_says_so_as_openai_does(client: openai.OpenAI, fields: dict) -> None:
    """The code and the words client libraries look for (litellm's ContextWindowExceededError, LangChain's
    ContextOverflowError) to trim a conversation and try again."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, **fields)
    error = caught.value.body
    assert error["code"] == "context_length_exceeded", error
    assert error["message"].startswith("This model's maximum context length is "), error
    assert error["param"] == next(k for k in ("max_completion_tokens", "max_tokens", "messages") if k in fields)


def test_preemptions_are_counted_in_metrics(tiny_llama_dir) -> None:
    """A pool too small for the streams at once preempts (frees a sequence's blocks, recomputes it later): an
    operator sees it in /metrics as sluice_preemptions_total, the engine's own count."""
    config = tiny_engine_config(tiny_llama_dir, num_kv_blocks=12, block_size=16, max_model_len=128)
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL) as small:
        body = {**COMPLETION, "max_tokens": 60, "ignore_eos": True}
        with httpx.Client(base_url=small.base_url, timeout=60) as http, ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda _: http.post("/v1/completions", json=body).json(), range(6)))
            assert all(r["usage"]["completion_tokens"] == 60 for r in results), results
            families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
        counted = families["sluice_preemptions"].samples[0]
        assert counted.name == "sluice_preemptions_total"
        assert counted.value == small.engine.num_preemptions > 0


def scrape(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics: (name, its labels sorted) -> value."""
    families = text_string_to_metric_families(http.get("/metrics").text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def test_metrics_count_answers_by_status_finishes_by_reason_and_tokens_as_they_stream(
    http: httpx.Client, server: ThreadedServer
) -> None:
    before = scrape(http)
    assert http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 0}).status_code == 400
    assert http.get("/v1/nothing-here").status_code == 404
    prompt = "The quick brown fox jumps over the lazy dog. " * 6  # several whole blocks: a hit the second time
    for _ in range(2):
        http.post("/v1/completions", json={**COMPLETION, "prompt": prompt, "max_tokens": 3, "ignore_eos": True})
    before_stream = scrape(http)
    with wrapped_execute(server.engine, slowed(0.02)):
        # n choices decode in one step: their deltas arrive together and are not gaps between tokens
        body = {**COMPLETION, "n": 4, "max_tokens": 30, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            num_events = 0
            while num_events < 10:
                num_events += next(lines).startswith("data: ")
            during = scrape(http)
            for _ in lines:
                pass
    after = scrape(http)

    def grew(name: str, labels: tuple = (), since: dict = before, until: dict = after) -> float:
        return until.get((name, labels), 0.0) - since.get((name, labels), 0.0)

    assert grew("sluice_http_responses_total", (("status", "400"),)) == 1
    assert grew("sluice_http_responses_total", (("status", "404"),)) == 1
    assert grew("sluice_http_responses_total", (("status", "200"),)) == 3  # not the scrapes
    assert grew("sluice_requests_finished_total", (("finished_reason", "length"),)) == 3
    assert grew("sluice_prefix_cache_hits_total") >= 48 and grew("sluice_prefix_cache_queries_total") >= 96
    assert grew("sluice_generation_tokens_total", until=during) >= 8  # the stream's, before it ended
    assert grew("sluice_requests_finished_total", (("finished_reason", "length"),), until=during) == 2
    assert grew("sluice_generation_tokens_total") == 2 * 3 + 4 * 30
    gaps = grew("sluice_inter_token_latency_seconds_count", since=before_stream)
    fast = grew("sluice_inter_token_latency_seconds_bucket", (("le", "0.005"),), since=before_stream)
    assert 0 < gaps <= 4 * 29 and fast == 0  # each choice's gaps: steps of at least 20 ms
    assert after[("sluice_kv_pool_blocks", ())] == server.engine.num_total_blocks
    assert after[("sluice_kv_cache_usage_ratio", ())] == 0.0


def test_a_completion_max_tokens_left_out_is_16_and_null_is_the_rest_of_the_context(server: ThreadedServer,
                                                                                     http: httpx.Client) -> None:
    """OpenAI's default for /v1/completions is 16; an explicit null asks for no limit (vLLM: up to the context)."""
    body = {k: v for k, v in COMPLETION.items() if k != "max_tokens"} | {"ignore_eos": True}
    assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 16
    usage = http.post("/v1/completions", json={**body, "max_tokens": None}).json()["usage"]
    assert usage["total_tokens"] == server.engine.max_model_len, usage


def test_a_list_of_prompts_streams_as_its_whole_response(client: openai.OpenAI, server: ThreadedServer) -> None:
    """OpenAI streams a list of completion prompts: prompt p's choice i is index p * n + i, each choice ends
    once, the usage counts every prompt; the text of each index is the non-streamed one's."""
    prompts = ["The quick brown fox", "日本の首都は", "Once upon a time, in a land far away"]
    body = dict(model=MODEL, prompt=prompts, max_tokens=9, temperature=0, n=2, logprobs=1)
    whole = client.completions.create(**body)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    chunks = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason:
            assert choice.index not in finishes
            finishes[choice.index] = choice.finish_reason
    assert {c.index: c.text for c in whole.choices} == texts and len(texts) == 6
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert server.engine.num_free_blocks == server.engine.num_total_blocks


def test_a_client_that_leaves_a_stream_of_prompts_aborts_them_all(server: ThreadedServer) -> None:
    body = {**COMPLETION, "prompt": ["one", "two", "three"], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with wrapped_execute(server.engine, slowed(0.01)):
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                wait_until(lambda: health(server.base_url)[1]["running"] == 3)
        wait_until(lambda: health(server.base_url)[1]["running"] == 0, timeout=5)  # within a few steps
    wait_until(lambda: server.engine.num_free_blocks == server.engine.num_total_blocks, timeout=5)


def test_fields_sluice_does_not_read_are_served_and_named_once_in_the_log(http: httpx.Client, caplog) -> None:
    body = {**COMPLETION, "max_tokens": 2, "x_vendor_k": 4, "x_vendor_flag": True}
    with caplog.at_level("WARNING", logger="sluice.server"):
        for _ in range(2):
            assert http.post("/v1/completions", json=body).status_code == 200
        chat = {**CHAT, "max_tokens": 2, "x_vendor_k": 4, "x_vendor_n": 1}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
    warnings = [r.getMessage() for r in caplog.records if "ignored request field" in r.getMessage()]
    assert warnings == [
        "/v1/completions: ignored request field(s) 'x_vendor_k', 'x_vendor_flag': Sluice does not read them "
        "(each name is logged once)",
        "/v1/chat/completions: ignored request field(s) 'x_vendor_n': Sluice does not read them (each name is "
        "logged once)",
    ]


@pytest.mark.parametrize(
    "fields",
    [{"messages": CHAT["messages"]}, {"prompt": "Hello"}, {"prompt": ["Hello", "world"]}],
    ids=["chat", "completion", "completion batch"],
)
def test_a_failure_while_writing_a_stream_still_ends_it_with_an_error_event_and_done(
    server: ThreadedServer, http: httpx.Client, monkeypatch: pytest.MonkeyPatch, fields: dict[str, Any]
) -> None:
    """A bug while writing a chunk (the tool-call parser's RecursionError on deep JSON was one) cut the connection
    mid-stream: the client got neither a terminal event nor [DONE]. The request is aborted and its KV freed."""
    def broken(self: Any, output: Any) -> list[dict]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(ChatResponses, "delta_chunks", broken)
    monkeypatch.setattr(CompletionResponses, "delta_chunks", broken)
    path = "/v1/chat/completions" if "messages" in fields else "/v1/completions"
    with http.stream("POST", path, json={"model": MODEL, "max_tokens": 8, "stream": True, **fields}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1, lines
    error = orjson.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "a bug" not in error["message"], error
    wait_until(lambda: engine_idle(server.base_url), timeout=30)
    monkeypatch.undo()
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200
