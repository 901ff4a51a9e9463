"""The /v1/responses tests' model: the tiny Llama with a Hermes tool-call chat template."""

from __future__ import annotations

from pathlib import Path

from tests.support.tiny_models import build_tokenizer, save_tiny_llama
from tests.support.tool_templates import HERMES_TEMPLATE


MODEL = "tiny-responses"


def tiny_tool_model(path: Path) -> Path:
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.chat_template = HERMES_TEMPLATE
    return save_tiny_llama(path, tokenizer=tokenizer, vocab_size=len(tokenizer), max_position_embeddings=2048)
