"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a list of strings, or a
Lark grammar. The fields are named as vLLM's `structured_outputs`; exactly one is set.

Pure data, checked on construction (InvalidRequest naming `param`); engine/grammar_compiler.py turns it into a
matcher, and a grammar that does not compile is an InvalidRequest naming `param` too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequest

# Bounds on what a request may bring: the grammar is compiled in the input processor's thread.
MAX_GRAMMAR_CHARS = 100_000
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutputs:
    json: dict[str, Any] | str | None = None  # a JSON schema (a dict or its JSON text)
    regex: str | None = None  # the whole output matches it (Rust regex syntax)
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a Lark grammar in llguidance's dialect (%json{...} embeds a schema)
    json_object: bool = False  # any JSON object ({"type": "object"})
    param: str = "structured_outputs"  # the request parameter named when this cannot be honoured

    def __post_init__(self) -> None:
        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            message = f"set exactly one of json, regex, choice, grammar, json_object; got {kinds}"
            raise InvalidRequest(message, self.param)
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequest("json must be a JSON schema (an object or its JSON text)", self._param("json"))
        if isinstance(self.json, dict):
            try:
                json.dumps(self.json)
            except (TypeError, ValueError) as error:  # a set, bytes, NaN...: no JSON schema holds it
                raise InvalidRequest(f"json is not JSON: {error}", self._param("json")) from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequest(f"{name} must be a non-empty string", self._param(name))
        choice = self.choice
        if choice is not None:
            if not isinstance(choice, list) or not choice or not all(isinstance(c, str) and c for c in choice):
                raise InvalidRequest("choice must be a non-empty list of non-empty strings", self._param("choice"))
            if len(choice) > MAX_CHOICES:
                raise InvalidRequest(f"choice has {len(choice)} entries, at most {MAX_CHOICES}", self._param("choice"))
        if len(self.source_text()) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(f"the constraint is longer than {MAX_GRAMMAR_CHARS} characters", self.param)

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)

    def error_param(self) -> str:
        """The parameter a compile error names: the field itself under structured_outputs, else self.param."""
        return self._param(self.kind)

    def _param(self, field_name: str) -> str:
        return f"{self.param}.{field_name}" if self.param == "structured_outputs" else self.param

    def source_text(self) -> str:
        if self.json is not None:
            return self.json if isinstance(self.json, str) else json.dumps(self.json)
        if self.choice is not None:
            return "".join(self.choice)
        return self.regex or self.grammar or ""
