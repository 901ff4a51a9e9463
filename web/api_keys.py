"""API keys: every route needs `Authorization: Bearer <key>` except /health and the chat page itself."""

from __future__ import annotations

import hashlib
import hmac

from quart import Quart, request

from engine.config import ServerConfig
from web.errors import APIError

# The page loads without a key (it asks for one); /health is for load balancers and supervisors.
OPEN_PATHS = frozenset({"/", "/health", "/favicon.ico"})
OPEN_PREFIXES = ("/static/",)


def _digest(key: str) -> bytes:
    # Comparing fixed-length digests keeps the time of a comparison independent of the keys' lengths too.
    return hashlib.sha256(key.encode()).digest()


class KeyChecker:
    def __init__(self, keys: tuple[str, ...]) -> None:
        self._digests = [_digest(key) for key in keys]

    def is_valid(self, key: str) -> bool:
        given = _digest(key)
        # Every key is compared, so the time taken says nothing about which key (if any) matched.
        matches = [hmac.compare_digest(given, digest) for digest in self._digests]
        return any(matches)


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def needs_key(path: str, config: ServerConfig) -> bool:
    if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
        return False
    return config.metrics_need_key or path != "/metrics"


def unauthorized(message: str, error: str | None = None) -> APIError:
    headers = {"WWW-Authenticate": 'Bearer realm="sluice"' + (f', error="{error}"' if error else "")}
    if request.content_length or "Transfer-Encoding" in request.headers:
        # The body is left unread. Hypercorn then closes the connection, and without this header a client
        # that reuses it would lose its next request.
        headers["Connection"] = "close"
    return APIError(401, message, code="invalid_api_key", headers=headers)


def install_api_keys(app: Quart, config: ServerConfig) -> None:
    """Register the check (nothing when no key is configured). CORS preflights, which browsers send without
    credentials, never get here: the CORS middleware answers them first."""
    if not config.api_keys:
        return
    checker = KeyChecker(config.api_keys)

    @app.before_request
    async def require_api_key() -> None:
        if not needs_key(request.path, config):
            return
        token = bearer_token(request.headers.get("Authorization"))
        if token is None:
            raise unauthorized("this server needs an API key: send the header 'Authorization: Bearer <key>'")
        if not checker.is_valid(token):
            raise unauthorized("the API key is not valid", error="invalid_token")
