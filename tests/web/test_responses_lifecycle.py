"""/v1/responses streams on the engine's lifecycle: a client that leaves mid-stream frees its KV at once, and a
drain ends every open stream with exactly one terminal event (response.failed)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from tests.support.responses_events import check_event_grammar
from tests.support.server_harness import ThreadedServer, llm_engine_loader, slowed, tiny_engine_config, wait_until, wrapped_execute
from tests.support.tool_model import MODEL, tiny_tool_model


# A JSON array of 5000 integers: the grammar bans EOS until it is complete, which takes far more tokens.
ENDLESS = {"format": {"type": "json_schema", "name": "endless", "schema": {
    "type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}, "minItems": 5000}},
    "required": ["a"]}}}  # fmt: skip


def test_a_client_that_leaves_mid_stream_frees_its_kv(tmp_path: Path) -> None:
    config = tiny_engine_config(tiny_tool_model(tmp_path), max_model_len=2048)
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL) as server:
        engine = server.engine
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        with wrapped_execute(engine, slowed(0.02)):
            # ENDLESS: the sampled answer cannot end on an EOS before the client leaves (it did once in CI)
            stream = client.responses.create(model=MODEL, input="Hello world " * 20, max_output_tokens=1000,
                                             stream=True, text=ENDLESS)  # fmt: skip
            for event in stream:
                if event.type == "response.output_text.delta":
                    break
            assert engine.num_free_blocks < engine.num_total_blocks and engine.num_running == 1
            stream.close()
            wait_until(lambda: engine.num_running == 0 and engine.num_free_blocks == engine.num_total_blocks, 10)
        assert server.async_engine.stats().pending == 0


def test_a_drain_ends_each_open_stream_with_one_terminal_event(tmp_path: Path) -> None:
    config = tiny_engine_config(tiny_tool_model(tmp_path), max_model_len=2048)
    server = ThreadedServer(llm_engine_loader(config), served_model_name=MODEL, drain_timeout=3.0)
    with server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        started = [threading.Event() for _ in range(3)]

        def read(i: int) -> list[dict]:
            events = []
            body = dict(model=MODEL, input=f"Hello {i}", max_output_tokens=3 if i == 0 else 1900, stream=True,
                        text=ENDLESS)  # no stream can end by itself before its max_output_tokens
            for event in client.responses.create(**body):
                events.append(event.to_dict(warnings=False))
                started[i].set()
            return events

        with wrapped_execute(server.engine, slowed(0.02)), ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(read, i) for i in range(3)]
            assert all(event.wait(30) for event in started)
            server.stop()
            results = [f.result(timeout=30) for f in futures]
    finals = [check_event_grammar(events) for events in results]
    assert finals[0]["status"] == "incomplete"
    for final in finals[1:]:
        assert final["status"] == "failed" and final["error"]["code"] == "server_error"
        assert "shutting down" in final["error"]["message"]


def failing(execute):
    def fail(plan):
        raise RuntimeError("the forward pass broke")

    return fail


def test_a_failed_forward_pass_ends_the_stream_with_response_failed(tmp_path: Path) -> None:
    config = tiny_engine_config(tiny_tool_model(tmp_path), max_model_len=2048)
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        with wrapped_execute(server.engine, failing):
            events = [e.to_dict(warnings=False) for e in client.responses.create(model=MODEL, input="Hi", stream=True)]
            with pytest.raises(openai.InternalServerError):
                client.responses.create(model=MODEL, input="Hi")
        final = check_event_grammar(events)
        assert final["status"] == "failed" and final["error"]["code"] == "server_error" and final["error"]["message"]
        assert client.responses.retrieve(final["id"]).status == "failed"  # stored as it ended
        after = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)  # the engine serves on
        # sampled: the tiny model may end on its EOS within the 3 tokens (completed) or be cut at them (incomplete)
        assert after.status in ("completed", "incomplete") and 1 <= after.usage.output_tokens <= 3
        assert server.engine.num_free_blocks == server.engine.num_total_blocks


def test_a_stored_response_in_progress_is_found_and_said_to_be_in_progress(tmp_path: Path) -> None:
    """store: true keeps a response from its response.created event on, as OpenAI does: GET shows it in_progress
    (and its input items), previous_response_id is told it is still in progress (not that it does not exist),
    DELETE waits for it to finish; a client that leaves takes it away with it (not stored, nothing held)."""
    config = tiny_engine_config(tiny_tool_model(tmp_path), max_model_len=2048)
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL) as server:
        store = server.app.extensions["sluice"].response_store
        body = {"model": MODEL, "input": "Count", "max_output_tokens": 1000, "stream": True, "text": ENDLESS}
        with wrapped_execute(server.engine, slowed(0.02)), httpx.Client(base_url=server.base_url, timeout=60) as http:
            with http.stream("POST", "/v1/responses", json=body) as stream:
                data = (line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: "))
                response_id = orjson.loads(next(data))["response"]["id"]
                shown = http.get(f"/v1/responses/{response_id}")
                assert shown.status_code == 200 and shown.json()["status"] == "in_progress", shown.text
                items = http.get(f"/v1/responses/{response_id}/input_items").json()["data"]
                assert [item["content"][0]["text"] for item in items] == ["Count"]
                follow = http.post("/v1/responses", json={"model": MODEL, "input": "And?",
                                                          "previous_response_id": response_id})  # fmt: skip
                assert follow.status_code == 400 and "still in progress" in follow.json()["error"]["message"]
                assert follow.json()["error"]["param"] == "previous_response_id"
                assert http.delete(f"/v1/responses/{response_id}").status_code == 400
            wait_until(lambda: store.num_in_progress == 0, 10)
            assert http.get(f"/v1/responses/{response_id}").status_code == 404  # it was left unfinished: not stored
        whole = http_post_json(server, {**body, "stream": False, "text": None, "max_output_tokens": 2})
        assert httpx.get(f"{server.base_url}/v1/responses/{whole['id']}").json()["status"] == whole["status"]
        assert store.num_in_progress == 0


def http_post_json(server: ThreadedServer, body: dict) -> dict:
    response = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()
