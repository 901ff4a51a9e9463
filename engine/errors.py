"""The one error type for bad requests: a ValueError that names the parameter at fault."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine cannot serve. `param` names the field at fault (OpenAI's error `param`), if one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
