"""The one error type for bad requests (a ValueError that names the parameter at fault), and what a failed load's
exceptions say when they are the loader's refusals."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine cannot serve. `param` names the field at fault (OpenAI's error `param`), if one is;
    `code` is OpenAI's error code where clients look for one ("context_length_exceeded")."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def load_refusals(error: BaseException) -> list[str] | None:
    """The messages of a load that failed only with ValueErrors (the loader's refusals: a truncated file, an
    unsupported architecture or type, a KV pool larger than memory), through task groups; None for any other
    failure."""
    if isinstance(error, BaseExceptionGroup):
        found = [load_refusals(e) for e in error.exceptions]
        return None if any(f is None for f in found) else [m for f in found for m in f]  # type: ignore[union-attr]
    return [str(error)] if isinstance(error, ValueError) else None
