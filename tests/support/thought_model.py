"""The reasoning tests' model and ids: the tiny Qwen 3 (its vocabulary has <think> and </think>) and a JSON schema
for the answer after the thought. Random weights write no thought of their own: logit_bias fills one with "h", and
penalties on the repeated "h" soon leave </think> the likeliest."""

from __future__ import annotations

from typing import Any

MODEL = "tiny-qwen3"
START, END, H = 382, 383, 74  # <think>, </think>, "h" (each test module's server checks them)
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}  # fmt: skip


def schema_chat(bias: dict[int, int], **fields: Any) -> dict[str, Any]:
    """A chat request whose answer is SCHEMA's JSON, with these logit biases and penalties that end the thought."""
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
            "logit_bias": {str(token): value for token, value in bias.items()}, "presence_penalty": 2,
            "frequency_penalty": 2, **fields}  # fmt: skip
