"""JSON bodies through orjson: faster than the stdlib, and it never emits invalid UTF-8."""

from __future__ import annotations

from typing import Any

import orjson
from quart import Response


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)


def json_response(value: Any, status: int = 200) -> Response:
    return Response(dumps(value), status=status, content_type="application/json")


async def send_json(send: Any, status: int, value: Any) -> None:
    """A whole JSON response through a raw ASGI `send`, for middleware that answers before the app runs."""
    body = dumps(value)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
