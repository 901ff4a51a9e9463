"""OpenAI's strict mode for JSON schemas: an object schema that lists its properties and says nothing about
others allows no others. Applied to tool parameters (always constrained) and to response_format json_schema
with strict: true. Without it a small model, free to add properties, tends to add them until max_tokens."""

from __future__ import annotations

from typing import Any

_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalItems", "not", "if", "then", "else", "contains")


def closed_objects(schema: Any) -> Any:
    """A copy of schema with "additionalProperties": false added to every object schema that has "properties"
    and no "additionalProperties" of its own."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    return out
