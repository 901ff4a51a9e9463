"""CORS: browser pages on the configured origins may call the API, streams and error responses included.

A preflight (OPTIONS with Access-Control-Request-Method) from an allowed origin is answered 204 before any
other check; from another origin, 403 without CORS headers, so the browser stops there. Every response to
an allowed origin carries Access-Control-Allow-Origin, errors (401, 429, ...) too, so that the page can
read them, and exposes the headers a client acts on.
"""

from __future__ import annotations

from quart import Quart, Response, request

from engine.config import ServerConfig
from web.errors import APIError

ALLOWED_METHODS = "GET, POST, OPTIONS"
EXPOSED_HEADERS = "Retry-After, WWW-Authenticate"
PREFLIGHT_MAX_AGE_SECONDS = 600


class OriginPolicy:
    def __init__(self, origins: tuple[str, ...]) -> None:
        self.allows_any = "*" in origins
        self._origins = frozenset(origins)

    def allows(self, origin: str | None) -> bool:
        return origin is not None and (self.allows_any or origin in self._origins)

    def allow_origin_value(self, origin: str) -> str:
        # "*" needs no Vary; an echoed origin does. No credentials mode: keys travel in Authorization.
        return "*" if self.allows_any else origin


def install_cors(app: Quart, config: ServerConfig) -> None:
    """Register the preflight answer and the response headers (nothing when no origin is configured)."""
    if not config.cors_origin_list:
        return
    policy = OriginPolicy(config.cors_origin_list)

    @app.before_request
    async def answer_preflight() -> Response | None:
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return None
        origin = request.headers.get("Origin")
        if not policy.allows(origin):
            raise APIError(403, f"the origin {origin!r} is not allowed (cors_origins)", code="origin_not_allowed")
        response = Response("", status=204)
        response.headers["Access-Control-Allow-Methods"] = ALLOWED_METHODS
        # "*" in Allow-Headers would not cover Authorization: echo what the page asks for.
        requested = request.headers.get("Access-Control-Request-Headers")
        if requested:
            response.headers["Access-Control-Allow-Headers"] = requested
        response.vary.add("Access-Control-Request-Headers")
        response.headers["Access-Control-Max-Age"] = str(PREFLIGHT_MAX_AGE_SECONDS)
        return response

    @app.after_request
    async def add_cors_headers(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if not policy.allows_any:
            response.vary.add("Origin")
        if origin is not None and policy.allows(origin):
            response.headers["Access-Control-Allow-Origin"] = policy.allow_origin_value(origin)
            response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        return response
