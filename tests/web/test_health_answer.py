"""GET /health is answered before Quart's request machinery (web/health_answer.py), as Quart answered it."""

from __future__ import annotations

import orjson
import pytest

from engine.async_engine import AsyncEngine
from engine.config import ServerConfig
from web.app import create_app

ORIGIN = "https://app.example"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def app_with(**overrides: object):
    return create_app(AsyncEngine(lambda: None, max_pending=1), ServerConfig(**overrides))  # never loaded: 503


def num_responses(app, status: str) -> float:
    return app.extensions["sluice"].metrics.registry.get_sample_value("sluice_http_responses_total", {"status": status}) or 0


@pytest.mark.anyio
async def test_health_is_answered_without_quarts_request_handling() -> None:
    app = app_with(api_key="k")  # /health stays open with keys set
    requests_seen: list[str] = []

    @app.before_request
    async def record() -> None:
        from quart import request

        requests_seen.append(request.path)

    client = app.test_client()
    response = await client.get("/health?verbose=1")
    assert response.status_code == 503 and response.headers["Content-Type"] == "application/json"
    body = await response.get_data()
    assert int(response.headers["Content-Length"]) == len(body)
    assert orjson.loads(body) == {"state": "loading", "waiting": 0, "running": 0, "pending": 0, "free_kv_blocks": 0,
                                  "total_kv_blocks": 0}  # fmt: skip
    assert requests_seen == []
    assert num_responses(app, "503") == 1  # counted as every answer of the app is


@pytest.mark.anyio
async def test_health_head_and_other_methods_answer_as_before() -> None:
    app = app_with()
    client = app.test_client()
    head = await client.head("/health")
    assert head.status_code == 503 and head.headers["Content-Type"] == "application/json"
    assert (await client.post("/health")).status_code == 405  # Quart's own answer: the route takes GET and HEAD
    assert (await client.get("/health/")).status_code == 404
    assert num_responses(app, "503") == 1 and num_responses(app, "405") == 1


@pytest.mark.anyio
async def test_health_carries_cors_headers() -> None:
    client = app_with(cors_origins=ORIGIN).test_client()
    response = await client.get("/health", headers={"Origin": ORIGIN})
    assert response.status_code == 503 and response.headers["Access-Control-Allow-Origin"] == ORIGIN
