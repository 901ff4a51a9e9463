"""CORS: browser pages on the configured origins may call the API, streams and error responses included.

ASGI middleware, outermost: a preflight (OPTIONS with Access-Control-Request-Method) from an allowed origin is
answered 204 before anything else runs (the API key check included: browsers send preflights without
credentials); from another origin, 403 without CORS headers, so the browser stops there. Every other
response to an allowed origin carries Access-Control-Allow-Origin, errors too (401, 413, 429: the page can
read them), and exposes the headers a client acts on.
"""

from __future__ import annotations

from typing import Any

from web.errors import error_body
from web.json_response import send_json

ALLOWED_METHODS = b"GET, POST, DELETE, OPTIONS"  # DELETE: /v1/responses/{id}
EXPOSED_HEADERS = b"Retry-After, WWW-Authenticate"
PREFLIGHT_MAX_AGE_SECONDS = 600


class OriginPolicy:
    def __init__(self, origins: tuple[str, ...]) -> None:
        self.allows_any = "*" in origins
        self._origins = frozenset(origin.encode() for origin in origins)

    def allows(self, origin: bytes | None) -> bool:
        return origin is not None and (self.allows_any or origin in self._origins)

    def response_headers(self, origin: bytes | None) -> list[tuple[bytes, bytes]]:
        # "*" needs no Vary; an echoed origin does. No credentials mode: keys travel in Authorization.
        headers = [] if self.allows_any else [(b"vary", b"Origin")]
        if self.allows(origin):
            assert origin is not None
            allowed = b"*" if self.allows_any else origin
            headers += [(b"access-control-allow-origin", allowed), (b"access-control-expose-headers", EXPOSED_HEADERS)]
        return headers


class CORS:
    def __init__(self, app: Any, origins: tuple[str, ...]) -> None:
        self.app = app
        self.policy = OriginPolicy(origins)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))  # ASGI header names are lower-case
        origin = headers.get(b"origin")
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            await self._answer_preflight(origin, headers.get(b"access-control-request-headers"), send)
            return
        extra = self.policy.response_headers(origin)

        async def send_with_cors(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    async def _answer_preflight(self, origin: bytes | None, requested: bytes | None, send: Any) -> None:
        if not self.policy.allows(origin):
            shown = origin.decode("latin-1") if origin is not None else None
            message = f"the origin {shown!r} is not allowed (cors_origins)"
            await send_json(send, 403, error_body(403, message, code="origin_not_allowed"))
            return
        headers = self.policy.response_headers(origin) + [
            (b"access-control-allow-methods", ALLOWED_METHODS),
            (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_SECONDS).encode()),
            (b"vary", b"Access-Control-Request-Headers"),
        ]
        if requested:
            # "*" in Allow-Headers would not cover Authorization: echo what the page asks for.
            headers.append((b"access-control-allow-headers", requested))
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
