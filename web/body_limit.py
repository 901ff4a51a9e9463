"""413 for request bodies over max_body_bytes, readable by every client.

Answering before the body has arrived makes the server close a connection the client is still writing to,
and the client then sees a reset instead of the 413 (Quart's own check does that). So a request that
declares a body over the limit is read to its end and dropped, bounded by the body timeout and a cap on what
is worth reading, and then gets the error in OpenAI's shape. Chunked bodies without a declared length are
left to Quart's check, which stops at the limit.
"""

from __future__ import annotations

from typing import Any

import anyio

from web.errors import error_body
from web.json_response import send_json

# Beyond this many bytes, reading a body only to refuse it costs more than the reset it avoids.
MAX_DRAINED_BYTES = 64 * 1024 * 1024


class BodyLimit:
    def __init__(self, app: Any, max_body_bytes: int, body_timeout: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            num_bytes = _content_length(scope)
            if num_bytes is not None and num_bytes > self.max_body_bytes:
                await self._refuse(num_bytes, receive, send)
                return
        await self.app(scope, receive, send)

    async def _refuse(self, num_bytes: int, receive: Any, send: Any) -> None:
        if num_bytes <= MAX_DRAINED_BYTES:
            with anyio.move_on_after(self.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] != "http.request" or not message.get("more_body", False):
                        break
        message = f"the request body has {num_bytes} bytes, over the limit of {self.max_body_bytes} (max_body_bytes)"
        await send_json(send, 413, error_body(413, message, code="request_too_large"))


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
