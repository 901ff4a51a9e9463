"""Request fields Sluice does not read. As vLLM does, a request that carries some is served (clients send other
servers' extensions), and the log names them: each name once, so a client that sends one on every request does
not flood the log, and at most MAX_REPORTED names are remembered, so random names cannot grow memory."""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

from pydantic import BaseModel
from quart import has_request_context, request

logger = logging.getLogger("sluice.server")

MAX_REPORTED = 256
MAX_NAME_CHARS = 64
_reported: set[str] = set()


@cache
def field_names(model: type[BaseModel]) -> frozenset[str]:
    """The top-level keys a request model reads: its fields' names and their aliases."""
    names = set(model.model_fields)
    names.update(field.alias for field in model.model_fields.values() if field.alias)
    return frozenset(names)


def report_ignored_fields(model: type[BaseModel], body: dict[str, Any]) -> None:
    known = field_names(model)
    new = [key for key in body if key not in known and key not in _reported]
    new = new[: max(0, MAX_REPORTED - len(_reported))]
    if not new:
        return
    _reported.update(new)
    where = request.path if has_request_context() else model.__name__
    shown = ", ".join(repr(name[:MAX_NAME_CHARS]) for name in new)
    logger.warning("%s: ignored request field(s) %s: Sluice does not read them (each name is logged once)", where, shown)
