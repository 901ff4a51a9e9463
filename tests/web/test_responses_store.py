"""The response store: bounded by count, bytes and age (unit), within its caps under a flood of large stored
responses through the server, and per-API-key visibility."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from web.responses_api.store import ENTRY_OVERHEAD_BYTES, ResponseStore

from tests.support.server_harness import ThreadedServer, llm_engine_loader, tiny_engine_config
from tests.support.tool_model import MODEL, tiny_tool_model


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_oldest_go_first_when_count_or_bytes_are_over() -> None:
    store = ResponseStore(max_count=3, max_bytes=10 * (100 + ENTRY_OVERHEAD_BYTES), ttl=60)
    for i in range(5):
        assert store.put(f"r{i}", None, b"x" * 100, b"")
    assert len(store) == 3 and [store.get(f"r{i}", None) is not None for i in range(5)] == [False] * 2 + [True] * 3
    big = b"y" * (8 * (100 + ENTRY_OVERHEAD_BYTES))  # room for it only when r2 (count) and r3 (bytes) go
    assert store.put("big", None, big, b"")
    assert [store.get(f"r{i}", None) is not None for i in (3, 4)] == [False, True]
    assert store.num_bytes == len(big) + 100 + 2 * ENTRY_OVERHEAD_BYTES <= store.max_bytes
    assert not store.put("huge", None, b"z" * store.max_bytes, b"")  # larger than the whole budget: not kept
    assert store.get("huge", None) is None and store.get("big", None) is not None


def test_entries_expire_after_the_ttl() -> None:
    clock = Clock()
    store = ResponseStore(max_count=10, max_bytes=1 << 20, ttl=30, clock=clock)
    store.put("old", None, b"{}", b"[]")
    clock.now = 20
    store.put("new", None, b"{}", b"[]")
    clock.now = 31
    assert store.get("old", None) is None and store.get("new", None) is not None
    clock.now = 51
    assert store.get("new", None) is None and len(store) == 0 and store.num_bytes == 0


def test_an_entry_is_seen_and_deleted_by_its_owner_only() -> None:
    store = ResponseStore(max_count=10, max_bytes=1 << 20, ttl=30)
    store.put("r", b"a", b"{}", b"[]")
    assert store.get("r", b"b") is None and store.get("r", None) is None and not store.delete("r", b"b")
    assert store.get("r", b"a") is not None and store.delete("r", b"a") and len(store) == 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_tool_model(tmp_path_factory.mktemp("tiny_tools"))


def test_a_response_in_progress_is_its_owners_until_it_ends() -> None:
    store = ResponseStore(max_count=3, max_bytes=10_000, ttl=60)
    store.begin("r", b"me", lambda: b"{}", b"[]")
    assert store.in_progress("r", b"me") is not None and store.in_progress("r", b"other") is None
    assert store.get("r", b"me") is None and store.num_in_progress == 1  # not stored until it is put
    store.end("r")
    store.end("r")  # idempotent: a finished stream and its client's leaving may both end it
    assert store.in_progress("r", b"me") is None and store.num_in_progress == 0


def test_a_flood_of_large_stored_responses_stays_within_the_caps(model_dir: Path) -> None:
    max_bytes = 100_000
    config = tiny_engine_config(model_dir, max_model_len=2048, num_kv_blocks=1024)
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL, responses_store_max_count=20,
                        responses_store_max_bytes=max_bytes) as server:  # fmt: skip
        store = server.app.extensions["sluice"].response_store
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        metadata = {f"key{i}": "v" * 512 for i in range(16)}  # 8 KB, echoed in the stored response
        ids = []
        for i in range(40):
            response = client.responses.create(model=MODEL, input=f"{i} " + "Hello world! " * 120, metadata=metadata,
                                               max_output_tokens=2, stream=i % 2 == 1)  # fmt: skip
            if i % 2 == 1:  # a stream: the id is in its events
                response = [e for e in response][-1].response
            ids.append(response.id)
            held = [store.get(r, None) for r in ids]
            assert store.num_bytes == sum(e.num_bytes for e in held if e is not None) <= max_bytes
            assert all(len(e.body) > 8192 and len(e.conversation) > 1500 for e in held if e is not None)
        kept = [store.get(r, None) is not None for r in ids]
        assert kept[-1] and not kept[0] and kept == sorted(kept), "the oldest went first"
        assert 3 <= sum(kept) <= max_bytes // 10_000
        assert httpx.get(f"{server.base_url}/v1/responses/{ids[0]}").status_code == 404
        assert httpx.get(f"{server.base_url}/v1/responses/{ids[-1]}").status_code == 200


def test_a_stored_response_is_visible_to_its_key_only(model_dir: Path) -> None:
    config = tiny_engine_config(model_dir, max_model_len=2048)
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL, api_key="key-a,key-b") as server:
        a = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="key-a", max_retries=0)
        b = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="key-b", max_retries=0)
        mine = a.responses.create(model=MODEL, input="Hello", max_output_tokens=3)
        assert a.responses.retrieve(mine.id).id == mine.id
        for attempt in (lambda: b.responses.retrieve(mine.id), lambda: b.responses.delete(mine.id),
                        lambda: b.responses.create(model=MODEL, input="x", previous_response_id=mine.id)):  # fmt: skip
            with pytest.raises(openai.NotFoundError):
                attempt()
        assert a.responses.create(model=MODEL, input="x", previous_response_id=mine.id, max_output_tokens=2).id
        unauthorized = httpx.get(f"{server.base_url}/v1/responses/{mine.id}")
        assert unauthorized.status_code == 401
        a.responses.delete(mine.id)
        with pytest.raises(openai.NotFoundError):
            a.responses.retrieve(mine.id)


def test_a_store_of_none_keeps_nothing_and_says_nothing(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """responses_store_max_count = 0 is a choice: no response is kept, and no warning calls one too large."""
    config = tiny_engine_config(model_dir, max_model_len=2048)
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL, responses_store_max_count=0) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        with caplog.at_level("WARNING"):
            response = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2)
        assert response.status in ("completed", "incomplete")
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response.id)
        assert not [r for r in caplog.records if "response store" in r.getMessage()]
