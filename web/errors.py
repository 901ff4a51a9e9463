"""Every error leaves the server in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import anyio
from quart import Quart, Response, current_app, has_app_context, request
from werkzeug.exceptions import HTTPException

from engine.async_engine import EngineState, EngineUnavailable
from engine.errors import InvalidRequest
from engine.outputs import NOT_RUN, RequestOutput
from web.json_response import json_response

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
HTTP_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    415: "unsupported_media_type",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> Response:
        response = json_response(self.body(), self.status)
        response.headers.update(self.headers)
        return response


def failure_of(output: RequestOutput) -> APIError:
    """What a choice that ended without a result (finish_reason "error", or none) answers: the request's own error
    (a 400 with its code: a grammar past its limits), one the server could not run now (a 503 with Retry-After:
    every replica failed before it ran), or the engine's (a 500)."""
    if output.error_code == NOT_RUN:
        return unavailable(EngineState.LOADING, output.error or NOT_RUN)
    if output.error_code is not None:
        return APIError(400, output.error or output.error_code, code=output.error_code)
    return APIError(500, output.error or "the request ended without a result", code="engine_error")


def unavailable(state: EngineState, detail: str) -> APIError:
    """503: the engine takes no request now. Loading (or, with replicas, every replica restarting) ends by itself:
    the answer says when to try again (Retry-After; an answer in a stream's error event has no headers for it)."""
    headers = None
    if state is EngineState.LOADING and has_app_context():
        headers = {"Retry-After": str(current_app.extensions["sluice"].config.retry_after_seconds)}
    return APIError(503, f"the server is not accepting requests: {detail}", code=f"engine_{state.value}",
                    headers=headers)  # fmt: skip


# A message quotes what the client sent (a model's name, a response id): one sent 200 KB long is not sent back whole.
MAX_MESSAGE_CHARS = 1000


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    error_type = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 1] + "…"
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


async def drain_request_body(status: int) -> None:
    """Read what is left of the request's body before an error answers it. An error can come before the handler
    reads the body (415, 401, 503 while draining); Hypercorn cannot keep a connection whose request was not read
    to its end, so it closes it under a client still writing the body or about to send its next request there, and
    that request fails without a response. Bounded by the body limit (BodyLimit, Quart's) and the body timeout;
    a 408 or 413 (the body is late or too large) is answered at once."""
    if status in (408, 413):
        return
    with anyio.move_on_after(current_app.config["BODY_TIMEOUT"]), contextlib.suppress(Exception):
        await request.body


def register_error_handlers(app: Quart) -> None:
    @app.errorhandler(APIError)
    async def handle_api_error(error: APIError) -> Response:
        await drain_request_body(error.status)
        return error.response()

    @app.errorhandler(InvalidRequest)
    async def handle_invalid_request(error: InvalidRequest) -> Response:
        await drain_request_body(400)
        return APIError(400, error.message, param=error.param, code=error.code).response()

    @app.errorhandler(EngineUnavailable)
    async def handle_unavailable(error: EngineUnavailable) -> Response:
        await drain_request_body(503)
        return unavailable(error.state, str(error)).response()

    @app.errorhandler(HTTPException)
    async def handle_http_exception(error: HTTPException) -> Response:
        status = error.code or 500
        await drain_request_body(status)
        message = error.description or error.name
        if status == 413:  # a chunked body past the limit (a declared one gets web/body_limit.py's answer)
            limit = current_app.config["MAX_CONTENT_LENGTH"]
            message = f"the request body is over the limit of {limit} bytes (max_body_bytes)"
        response = APIError(status, message, code=HTTP_CODES.get(status)).response()
        if status == 405 and error.get_response().headers.get("Allow"):
            response.headers["Allow"] = error.get_response().headers["Allow"]
        return response

    @app.errorhandler(RecursionError)
    async def handle_too_deep(error: RecursionError) -> Response:
        # JSON the parser takes (up to 1,024 levels) that a schema's walk cannot: the request's doing, not a bug
        await drain_request_body(400)
        return APIError(400, "the request's JSON nests too deeply to be used (a schema or tool parameters)").response()

    @app.errorhandler(Exception)
    async def handle_unexpected(error: Exception) -> Response:
        # The client sees no detail of it (no repr, path or shape); the log has the traceback.
        logger.exception("unhandled error while serving a request")
        await drain_request_body(500)
        return APIError(500, "internal server error", code="internal_error").response()
