"""Requests Hypercorn refuses before the app sees them get OpenAI's error shape too, not an empty body: a request
line or headers over h11's limit (431: a huge header, cookie or URL) and bytes that are not HTTP/1.1 (400: a TLS
hello on the plain port, garbage). Hypercorn writes that answer itself (H11Protocol._send_error_response, with
`content-length: 0`, then closes the connection); this replaces that one method, for every launcher (the
lifespan's startup installs it, before any connection is served).
"""

from __future__ import annotations

from http import HTTPStatus

import h11
import orjson
from hypercorn.protocol.h11 import H11Protocol

from web.errors import error_body


def protocol_error_body(status: int, max_head_bytes: int) -> bytes:
    if status == 431:
        message = f"the request line and headers are over the limit of {max_head_bytes} bytes"
        body = error_body(status, message, code="request_header_fields_too_large")
    elif status == 400:
        body = error_body(status, "the request is not valid HTTP/1.1", code="invalid_http")
    else:
        body = error_body(status, HTTPStatus(status).phrase)
    return orjson.dumps(body)


async def send_json_error_response(self: H11Protocol, status_code: int) -> None:
    body = protocol_error_body(status_code, self.config.h11_max_incomplete_size)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    headers += [(b"connection", b"close"), *self.config.response_headers("h11")]
    await self._send_h11_event(h11.Response(status_code=status_code, headers=headers))
    await self._send_h11_event(h11.Data(data=body))
    await self._send_h11_event(h11.EndOfMessage())


def answer_protocol_errors_in_openai_shape() -> None:
    H11Protocol._send_error_response = send_json_error_response  # type: ignore[method-assign]
