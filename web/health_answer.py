"""GET /health answered at the ASGI layer, before Quart's request machinery.

A load balancer's probe must not wait behind the streams it checks on. Through Quart, a probe took three more laps
of the event loop than this (Quart starts a receiver task and a handler task, then runs the response under
`asyncio.wait_for`, a task of its own), and at 64 streams each lap can be one of the loop's bursts of SSE writes.
Here the answer goes out in the lap that starts the app. What a probe sees is Quart's answer (the same body and
headers; HEAD as Quart answers it: the headers, Hypercorn leaving out the body); the response is counted in
`sluice_http_responses_total`; the access log (Hypercorn's) and CORS (outside this) are as before. Other methods
go on to Quart (405).
"""

from __future__ import annotations

from typing import Any

from engine.async_engine import AsyncEngine, EngineState
from web.cluster.stats import ClusterStats
from web.json_response import send_json
from web.metrics import ServerMetrics

HEALTH_PATH = "/health"
ANSWERED_METHODS = frozenset({"GET", "HEAD"})


def health_answer(engine: AsyncEngine) -> tuple[dict[str, Any], int]:
    """/health's body and status: 503 unless ready."""
    stats = engine.stats()
    body: dict[str, Any] = {
        "state": stats.state,
        "waiting": stats.waiting,
        "running": stats.running,
        "pending": stats.pending,
        "free_kv_blocks": stats.free_kv_blocks,
        "total_kv_blocks": stats.total_kv_blocks,
    }
    if isinstance(stats, ClusterStats):
        body["replicas"] = stats.replicas_body()
    return body, 200 if stats.state == EngineState.READY.value else 503


class HealthAnswer:
    def __init__(self, app: Any, engine: AsyncEngine, metrics: ServerMetrics) -> None:
        self.app = app
        self.engine = engine
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != HEALTH_PATH or scope["method"] not in ANSWERED_METHODS:
            await self.app(scope, receive, send)
            return
        body, status = health_answer(self.engine)
        self.metrics.responses.labels(str(status)).inc()  # as the app's after_request counts every answer
        await send_json(send, status, body)
