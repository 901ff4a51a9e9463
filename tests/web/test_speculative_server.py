"""Speculation over HTTP: the `speculative` request field, burst-atomic stream events, /metrics counters."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from tests.support.server_harness import ThreadedServer, llm_engine_loader, stream_request, tiny_engine_config

PROMPT = "def add(a, b):\n    return a + b\n" * 3
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip


@pytest.fixture(scope="module")
def http(tiny_llama_dir) -> Iterator[httpx.Client]:
    config = tiny_engine_config(tiny_llama_dir, speculative="on")
    with ThreadedServer(llm_engine_loader(config), served_model_name="tiny") as server:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            yield client


def _accepted(http: httpx.Client) -> float:
    metrics = http.get("/metrics").text
    found = re.search(r'^sluice_speculative_accepted_tokens_total\{proposer="prompt"\} ([0-9.e+]+)$', metrics, re.M)
    assert found, metrics
    return float(found.group(1))


def test_a_stream_sends_each_steps_accepted_tokens_in_one_event_and_opting_out_changes_no_token(http):
    before = _accepted(http)
    events = stream_request(http, "/v1/completions", BODY).events[:-1]
    content = [e for e in events if e["choices"] and e["choices"][0]["text"]]
    text = "".join(e["choices"][0]["text"] for e in content)
    assert events[-1]["usage"]["completion_tokens"] == 40
    accepted = _accepted(http) - before
    assert accepted > 0
    assert len(content) < 40  # bursts: a step's accepted tokens travel as one event

    opted_out = stream_request(http, "/v1/completions", {**BODY, "speculative": False}).events[:-1]
    assert "".join(e["choices"][0]["text"] for e in opted_out if e["choices"]) == text
    assert _accepted(http) - before == accepted  # the opted-out request proposed nothing
    assert http.post("/v1/completions", json={**BODY, "speculative": "yes"}).status_code == 400
