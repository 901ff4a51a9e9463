"""API keys and CORS on a real Hypercorn server (tiny model), and the app's rules for other configurations."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine.async_engine import AsyncEngine
from engine.config import ServerConfig, load_config
from web.api_keys import KeyChecker, bearer_token
from web.app import create_app

from tests.support.server_harness import (
    ThreadedServer,
    health,
    llm_engine_loader,
    parse_sse,
    slowed,
    stream_request,
    tiny_engine_config,
    wait_until,
    wrapped_execute,
)

MODEL = "tiny"
KEYS = ("sk-first-key", "sk-second-key")
ORIGIN = "https://app.example"
OTHER_ORIGIN = "http://localhost:5173"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 8, "temperature": 0}
LONG = {"model": MODEL, "prompt": "Hello world", "max_tokens": 300, "temperature": 0, "ignore_eos": True}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> Iterator[ThreadedServer]:
    config = tiny_engine_config(tiny_llama_dir, max_num_seqs=1, max_num_batched_tokens=64)
    overrides = dict(api_key=",".join(KEYS), cors_origins=f"{ORIGIN},{OTHER_ORIGIN}", max_pending=1)
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL, **overrides) as server:
        yield server


@pytest.fixture(scope="module")
def http(server: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


# ---- API keys ------------------------------------------------------------------------------------------
def test_requests_without_a_valid_key_get_401_in_the_openai_shape(http: httpx.Client) -> None:
    for headers, challenge in (
        ({}, 'Bearer realm="sluice"'),
        (bearer("sk-wrong"), 'Bearer realm="sluice", error="invalid_token"'),
        (bearer(KEYS[0][:-1]), 'Bearer realm="sluice", error="invalid_token"'),  # a prefix is not the key
        (bearer(KEYS[0] + "x"), 'Bearer realm="sluice", error="invalid_token"'),
        ({"Authorization": f"Basic {KEYS[0]}"}, 'Bearer realm="sluice"'),
        ({"Authorization": "Bearer"}, 'Bearer realm="sluice"'),
    ):
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/v1/completions")):
            response = http.request(method, path, json=CHAT, headers=headers)
            assert response.status_code == 401, (headers, path)
            assert response.headers["www-authenticate"] == challenge
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    # An unknown route needs a key too: its existence is not revealed without one.
    assert http.get("/v1/nothing-here").status_code == 401
    assert http.get("/v1/nothing-here", headers=bearer(KEYS[0])).status_code == 404


def test_refused_requests_do_not_break_the_clients_next_request(http: httpx.Client) -> None:
    # A 401 leaves the body unread and the server closes the connection: it must say so (Connection: close),
    # or a client that reuses the connection loses its next request.
    for _ in range(40):
        response = http.post("/v1/completions", json={**LONG, "prompt": "x" * 2000})
        assert response.status_code == 401 and response.headers["connection"] == "close"
    assert http.get("/v1/models", headers=bearer(KEYS[0])).status_code == 200


def test_every_configured_key_works(http: httpx.Client) -> None:
    for key in KEYS:
        response = http.post("/v1/chat/completions", json=CHAT, headers=bearer(key))
        assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
        assert http.get("/v1/models", headers={"Authorization": f"bearer {key}"}).status_code == 200
        result = stream_request(httpx.Client(base_url=str(http.base_url), headers=bearer(key)), "/v1/completions",
                                {"model": MODEL, "prompt": "Hello", "max_tokens": 4})  # fmt: skip
        assert result.status == 200 and result.events[-1] == "[DONE]"


def test_health_and_the_chat_page_stay_open_and_metrics_need_a_key(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    page = http.get("/")
    assert page.status_code == 200 and "<title>Sluice</title>" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for asset in ("/static/chat.js", "/static/chat.css", "/static/index.html"):  # the page by its file name too
        answer = http.get(asset)
        assert answer.status_code == 200 and "frame-ancestors 'none'" in answer.headers["content-security-policy"]
        assert answer.headers["x-frame-options"] == "DENY"
    assert http.get("/metrics").status_code == 401
    assert http.get("/metrics", headers=bearer(KEYS[1])).status_code == 200


def test_every_key_is_compared_whichever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    checker = KeyChecker(("a", "bb", "ccc"))
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(len(a) + len(b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    for key, valid in (("a", True), ("ccc", True), ("nope", False), ("", False)):
        calls.clear()
        assert checker.is_valid(key) is valid
        assert len(calls) == 3  # no early exit: the time does not depend on which key matched
        assert set(calls) == {64}  # sha256 digests: the keys' lengths do not show either


def test_bearer_token_parsing() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer") is None
    assert bearer_token(None) is None


@pytest.mark.parametrize("bad", ["a,,b", " a", "a ,b", ","])
def test_malformed_key_lists_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(api_key=bad)


def test_keys_and_origins_come_from_environment_variables() -> None:
    config = load_config(environ={"SLUICE_API_KEY": "k1,k2", "SLUICE_CORS_ORIGINS": "*"}).server
    assert config.api_keys == ("k1", "k2") and config.cors_origin_list == ("*",)
    assert "k1" not in repr(config)  # keys never reach a log through the config's repr
    for never_matching in ("app.example", "https://app.example.com/", "https://App.Example.org",
                           "http://localhost:5173/chat", "https://user@app.example"):  # fmt: skip
        with pytest.raises(ValueError, match="cors_origins: .* as browsers send them"):
            ServerConfig(cors_origins=f"https://ok.example,{never_matching}")
    assert ServerConfig(cors_origins="https://a.example:8443,http://[::1]:5173,*").cors_origin_list[1] == "http://[::1]:5173"


# ---- CORS ----------------------------------------------------------------------------------------------
def preflight(http: httpx.Client, origin: str, path: str = "/v1/chat/completions") -> httpx.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    return http.options(path, headers=headers)


def test_preflight_from_an_allowed_origin_is_answered_without_a_key(http: httpx.Client) -> None:
    for origin in (ORIGIN, OTHER_ORIGIN):
        response = preflight(http, origin)
        assert response.status_code == 204
        assert response.headers["access-control-allow-origin"] == origin
        assert {"GET", "POST", "DELETE"} <= set(response.headers["access-control-allow-methods"].split(", "))
        assert response.headers["access-control-allow-headers"] == "authorization,content-type"
        assert int(response.headers["access-control-max-age"]) > 0
        assert "Origin" in response.headers["vary"]


def test_preflight_from_another_origin_is_refused_without_cors_headers(http: httpx.Client) -> None:
    response = preflight(http, "https://evil.example")
    assert response.status_code == 403 and response.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in response.headers
    response = http.post("/v1/chat/completions", json=CHAT, headers={**bearer(KEYS[0]), "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in response.headers  # served, but the browser will not show it


def test_streaming_works_cross_origin(http: httpx.Client) -> None:
    headers = {**bearer(KEYS[0]), "Origin": ORIGIN}
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == ORIGIN
        assert response.headers["content-type"].startswith("text/event-stream")
        events, _ = parse_sse(response.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 8


def test_errors_carry_cors_headers_so_the_page_can_read_them(server: ThreadedServer, http: httpx.Client) -> None:
    unauthorized = http.post("/v1/chat/completions", json=CHAT, headers={"Origin": ORIGIN})
    assert unauthorized.status_code == 401
    assert unauthorized.headers["access-control-allow-origin"] == ORIGIN
    assert "WWW-Authenticate" in unauthorized.headers["access-control-expose-headers"]
    bad = http.post("/v1/chat/completions", json={**CHAT, "temperature": 9}, headers={**bearer(KEYS[0]), "Origin": ORIGIN})
    assert bad.status_code == 400 and bad.headers["access-control-allow-origin"] == ORIGIN
    too_large = http.post("/v1/completions", content=b"x" * (server.config.max_body_bytes + 1),
                          headers={**bearer(KEYS[0]), "Origin": ORIGIN, "Content-Type": "application/json"})  # fmt: skip
    assert too_large.status_code == 413 and too_large.headers["access-control-allow-origin"] == ORIGIN

    # 429: one request running (max_num_seqs = 1), one queued (max_pending = 1), the third is refused.
    headers = {**bearer(KEYS[0]), "Origin": ORIGIN}
    with wrapped_execute(server.engine, slowed(0.01)), ThreadPoolExecutor(2) as pool:
        running = pool.submit(http.post, "/v1/completions", json=LONG, headers=headers)
        wait_until(lambda: health(server.base_url)[1]["running"] == 1)
        queued = pool.submit(http.post, "/v1/completions", json={**LONG, "max_tokens": 2}, headers=headers)
        wait_until(lambda: health(server.base_url)[1]["pending"] == 1)
        refused = http.post("/v1/completions", json=LONG, headers=headers)
        assert refused.status_code == 429
        assert refused.headers["access-control-allow-origin"] == ORIGIN
        assert "Retry-After" in refused.headers["access-control-expose-headers"] and refused.headers["retry-after"]
        assert running.result().status_code == 200 and queued.result().status_code == 200


# ---- other configurations (the app alone: these answers need no model) ------------------------------------
@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def app_with(**overrides: object):
    return create_app(AsyncEngine(lambda: None, max_pending=1), ServerConfig(**overrides))  # never loaded


@pytest.mark.anyio
async def test_without_cors_origins_no_cors_headers_are_sent() -> None:
    client = app_with().test_client()
    response = await client.get("/health", headers={"Origin": ORIGIN})
    assert "Access-Control-Allow-Origin" not in response.headers
    response = await client.options("/v1/models", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET"})
    assert response.status_code == 405 and "Access-Control-Allow-Origin" not in response.headers


@pytest.mark.anyio
async def test_any_origin_and_open_metrics() -> None:
    client = app_with(api_key="k", cors_origins="*", metrics_need_key=False).test_client()
    response = await client.get("/v1/models", headers={"Origin": "https://anywhere.example"})
    assert response.status_code == 401 and response.headers["Access-Control-Allow-Origin"] == "*"
    assert "Origin" not in response.headers.get("Vary", "")
    assert (await client.get("/metrics")).status_code == 200
    assert (await client.get("/v1/models", headers={"Authorization": "Bearer k"})).status_code == 503  # loading
