"""The one error type for bad requests: a ValueError that names the parameter at fault."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine cannot serve. `param` names the field at fault (OpenAI's error `param`), if one is;
    `code` is OpenAI's error code where clients look for one ("context_length_exceeded")."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
