"""A reasoning parser through a real server (tiny Qwen 3, whose tokenizer has <think> and </think> as tokens): the
thought comes back as reasoning_content / reasoning, the answer as content, streamed or whole. Random weights write
no thought of their own, so a grammar (structured outputs) makes them write one: the markers by token id, as
llguidance takes added tokens (it refuses a literal "<think>" spelt by the <think> token)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import httpx
import openai
import pytest

from engine.outputs import ChoiceOutput, FinishReason, RequestOutput
from engine.reasoning_parser import REASONING_PARSERS, Phase, ReasoningSplitter
from tests.support.responses_events import check_event_grammar
from tests.support.server_harness import (REPO, ThreadedServer, llm_engine_loader, stream_request, tiny_engine_config,
                                         wrapped_execute)
from web.responses import ChatResponses
from web.tool_calls.formats import HERMES

MODEL = "tiny-qwen3"
MESSAGES = [{"role": "user", "content": "Hello world"}]
START, END = 382, 383  # <think>, </think> in the tiny Qwen 3 vocabulary (checked below)
THOUGHT_THEN_ANSWER = f'start: <[{START}]> "\\n" /[a-z]{{3}}/ <[{END}]> "\\n\\n" /[a-z]{{2}}/'


def chat(grammar: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 32, "temperature": 0,
            "structured_outputs": {"grammar": grammar}, **fields}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir) -> Iterator[ThreadedServer]:
    config = tiny_engine_config(tiny_qwen3_dir, reasoning_parser="qwen3")
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL) as server:
        assert server.engine.tokenizer.convert_ids_to_tokens([START, END]) == ["<think>", "</think>"]
        yield server


@pytest.fixture(scope="module")
def http(server: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def streamed(http: httpx.Client, body: dict[str, Any], is_marker_content: bool = False) -> dict[int, dict[str, Any]]:
    """Per choice: its reasoning_content, reasoning, content (None where no delta had one) and logprobs entries."""
    stream = stream_request(http, "/v1/chat/completions", body)
    assert stream.status == 200 and stream.events[-1] == "[DONE]", stream.events
    choices: dict[int, dict[str, Any]] = {}
    for event in stream.events[:-1]:
        for choice in event["choices"]:
            got = choices.setdefault(choice["index"], {"reasoning_content": None, "reasoning": None, "content": None,
                                                       "logprobs": 0, "finish_reason": None})  # fmt: skip
            delta = choice["delta"]
            for key in ("reasoning_content", "reasoning", "content"):
                if delta.get(key):
                    if not (is_marker_content and key == "content"):
                        assert "<think>" not in delta[key] and "</think>" not in delta[key], delta
                    got[key] = (got[key] or "") + delta[key]
            got["logprobs"] += len((choice.get("logprobs") or {}).get("content") or [])
            got["finish_reason"] = choice["finish_reason"] or got["finish_reason"]
    choices[-1] = stream.events[-2].get("usage") or {}
    return choices


def test_a_thought_comes_back_as_reasoning_content_and_the_answer_as_content(http: httpx.Client) -> None:
    whole = http.post("/v1/chat/completions", json=chat(THOUGHT_THEN_ANSWER)).json()
    message = whole["choices"][0]["message"]
    assert len(message["reasoning_content"]) == 4 and message["reasoning_content"].startswith("\n"), message
    assert message["reasoning"] == message["reasoning_content"]
    assert len(message["content"]) == 4 and message["content"].startswith("\n\n"), message
    usage = whole["usage"]
    assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"]
    stream = streamed(http, chat(THOUGHT_THEN_ANSWER, stream_options={"include_usage": True}))
    assert {k: stream[0][k] for k in ("reasoning_content", "reasoning", "content")} == {
        "reasoning_content": message["reasoning_content"], "reasoning": message["reasoning"],
        "content": message["content"]}  # fmt: skip
    assert stream[-1]["completion_tokens_details"] == usage["completion_tokens_details"]


def test_the_openai_client_reads_the_reasoning(server: ThreadedServer) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    body = chat(THOUGHT_THEN_ANSWER)
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32, temperature=0,
                                              extra_body={"structured_outputs": body["structured_outputs"]})  # fmt: skip
    message = response.choices[0].message
    assert getattr(message, "reasoning_content", None) == message.model_extra["reasoning_content"]
    assert len(message.model_extra["reasoning_content"]) == 4 and len(message.content or "") == 4


def test_n_choices_and_logprobs_each_split_their_own_thought(http: httpx.Client) -> None:
    body = chat(THOUGHT_THEN_ANSWER, n=3, temperature=1.0, seed=5, logprobs=True)
    whole = http.post("/v1/chat/completions", json=body).json()
    stream = streamed(http, body)
    for choice in whole["choices"]:
        message, got = choice["message"], stream[choice["index"]]
        assert (got["reasoning_content"], got["content"]) == (message["reasoning_content"], message["content"])
        assert len(message["reasoning_content"]) == 4 and len(message["content"]) == 4
        assert len(choice["logprobs"]["content"]) == got["logprobs"]  # one per token, markers' tokens included
    assert len([c for c in whole["choices"]]) == 3
    assert sum(len(c["logprobs"]["content"]) for c in whole["choices"]) == whole["usage"]["completion_tokens"]


def test_a_thought_cut_by_max_tokens_or_a_stop_string_is_all_reasoning(http: httpx.Client) -> None:
    for fields in ({"max_tokens": 3}, {"stop": ["</think>"]}):
        body = chat(THOUGHT_THEN_ANSWER, **fields)
        message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message["content"] is None and message["reasoning_content"], (fields, message)
        got = streamed(http, body)[0]
        assert (got["reasoning_content"], got["content"]) == (message["reasoning_content"], None)
        usage = http.post("/v1/chat/completions", json=body).json()["usage"]
        assert usage["completion_tokens_details"]["reasoning_tokens"] == usage["completion_tokens"]


def test_output_with_no_thought_and_a_prompt_that_closed_it_are_all_content(http: httpx.Client) -> None:
    for body in (chat("start: /[a-z]{4}/"), chat("start: /[a-z]{4}/", chat_template_kwargs={"enable_thinking": False})):
        whole = http.post("/v1/chat/completions", json=body).json()
        message = whole["choices"][0]["message"]
        assert message["reasoning_content"] is None and message["reasoning"] is None, message
        assert message["content"] and len(message["content"]) >= 4
        assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
        got = streamed(http, body)[0]
        assert (got["reasoning_content"], got["content"]) == (None, message["content"])


def test_completions_keep_the_markers_in_their_text(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 16, "temperature": 0,
            "structured_outputs": {"grammar": THOUGHT_THEN_ANSWER}}  # fmt: skip
    text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert text.startswith("<think>") and "</think>" in text


def test_deepseek_r1_takes_output_up_to_the_end_marker_as_its_thought(tiny_qwen3_dir) -> None:
    config = tiny_engine_config(tiny_qwen3_dir, reasoning_parser="deepseek_r1")
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL) as server:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            body = chat(f"start: /[a-z]{{3}}/ <[{END}]> /[a-z]{{2}}/")
            message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
            assert len(message["reasoning_content"]) == 3 and len(message["content"]) == 2, message
            got = streamed(http, body)[0]
            assert (got["reasoning_content"], got["content"]) == (message["reasoning_content"], message["content"])
            # The template closed the thought in the prompt (enable_thinking false): all content, markers and all.
            body["chat_template_kwargs"] = {"enable_thinking": False}
            message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
            assert message["reasoning_content"] is None and "</think>" in message["content"], message
            got = streamed(http, body, is_marker_content=True)[0]
            assert (got["reasoning_content"], got["content"]) == (None, message["content"])


def test_a_parser_off_changes_nothing(tiny_qwen3_dir) -> None:
    config = tiny_engine_config(tiny_qwen3_dir)
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL) as server:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            whole = http.post("/v1/chat/completions", json=chat(THOUGHT_THEN_ANSWER)).json()
            message = whole["choices"][0]["message"]
            assert "reasoning_content" not in message and message["content"].startswith("<think>\n")
            assert "completion_tokens_details" not in whole["usage"]


@pytest.mark.parametrize("stream_by", [1, 3, 1000])
def test_tool_calls_are_read_from_the_answer_only(stream_by: int) -> None:
    """A call written inside the thought is reasoning; the one after it is a call (streamed in pieces, or whole)."""
    text = ('<think>maybe <tool_call>{"name": "no", "arguments": {}}</tool_call></think>'
            'Sure. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')  # fmt: skip
    syntax = REASONING_PARSERS["qwen3"]
    whole = ChatResponses(MODEL, None, False, False)  # type: ignore[arg-type]
    whole.read_tool_calls(HERMES.syntax)
    whole.read_reasoning(partial(ReasoningSplitter, syntax, Phase.BEFORE))
    result = ChoiceOutput(0)
    result.absorb(RequestOutput("r", [], text, finished=True, finish_reason=FinishReason.STOP))
    choice = whole.full_response([result])["choices"][0]
    assert choice["message"]["reasoning_content"] == 'maybe <tool_call>{"name": "no", "arguments": {}}</tool_call>'
    assert choice["message"]["content"] == "Sure. "
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "f", "arguments": '{"x": 1}'}]
    assert choice["finish_reason"] == "tool_calls"
    streaming = ChatResponses(MODEL, None, False, False)  # type: ignore[arg-type]
    streaming.read_tool_calls(HERMES.syntax)
    streaming.read_reasoning(partial(ReasoningSplitter, syntax, Phase.BEFORE))
    pieces = [text[i : i + stream_by] for i in range(0, len(text), stream_by)]
    # Markers whole in every delta, as the detokenizer holds them back: cut the text only between them.
    pieces = _whole_markers(pieces)
    deltas = []
    for i, piece in enumerate(pieces):
        output = RequestOutput("r", [], piece, finished=i == len(pieces) - 1, finish_reason=FinishReason.STOP)
        deltas += [chunk["choices"][0]["delta"] for chunk in streaming.delta_chunks(output)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == choice["message"]["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure. "
    arguments = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", []))
    assert arguments == '{"x": 1}'


def _whole_markers(pieces: list[str]) -> list[str]:
    joined: list[str] = []
    for piece in pieces:
        if joined and any(joined[-1].endswith(m[:k]) for m in ("<think>", "</think>") for k in range(1, len(m))):
            joined[-1] += piece
        else:
            joined.append(piece)
    return joined


def scripted(script: list[int]) -> Callable[[Callable], Callable]:
    """A forward pass whose sampled tokens are the script's, by each sequence's output position (one request at a
    time, no speculation): the Responses API has no grammar to force a thought with."""

    def wrap(execute: Callable) -> Callable:
        def scripted_execute(plan: Any) -> Any:
            output = execute(plan)
            for chunk, token in zip([c for c in plan.chunks if c.is_sampling], output.sampled):
                token.token_id = script[min(chunk.seq.num_output_tokens, len(script) - 1)]
            return output

        return scripted_execute

    return wrap


def test_the_responses_api_puts_the_thought_in_a_reasoning_item_before_the_message(server: ThreadedServer) -> None:
    tokenizer = server.engine.tokenizer
    script = [START, *tokenizer.encode("\nab"), END, *tokenizer.encode("\n\nok"), tokenizer.eos_token_id]
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    body = {"model": MODEL, "input": "Hello world", "max_output_tokens": 32, "temperature": 0}
    with wrapped_execute(server.engine, scripted(script)):
        whole = client.responses.create(**body).model_dump()
        events = [event.model_dump() for event in client.responses.create(**body, stream=True)]
        turns = [{"role": "user", "content": "Hello world"}, *whole["output"], {"role": "user", "content": "And?"}]
        again = client.responses.create(**{**body, "input": turns})
    reasoning, message = whole["output"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "\nab"}]
    assert message["type"] == "message" and message["content"][0]["text"] == "\n\nok"
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 1 + len(tokenizer.encode("\nab")) + 1
    final = check_event_grammar(events)
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == reasoning["content"] and final["output"][1]["content"] == message["content"]
    assert final["usage"] == whole["usage"]
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == "\nab" and not any("think>" in d for d in deltas)
    assert again.status == "completed"  # a reasoning item sent back as input is taken (and left out of the prompt)


def test_an_unknown_parser_fails_the_start_in_one_line_naming_the_choices() -> None:
    for args, env in ((["--reasoning-parser", "qwen"], {}), ([], {"SLUICE_REASONING_PARSER": "r1"})):
        done = subprocess.run([sys.executable, "-m", "web.cli", "serve", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=120, env={**os.environ, **env})  # fmt: skip
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip().splitlines() == [
            f"configuration error: reasoning_parser must be one of qwen3, deepseek_r1 or \"\" (off), got "
            f"{(args[1:] or [env.get('SLUICE_REASONING_PARSER')])[0]!r}"]
