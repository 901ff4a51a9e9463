"""JSON bodies through orjson: faster than the stdlib, and it never emits invalid UTF-8."""

from __future__ import annotations

from typing import Any

import orjson
from quart import Response


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)


def json_response(value: Any, status: int = 200) -> Response:
    return Response(dumps(value), status=status, content_type="application/json")
