"""Logprobs in OpenAI's shapes. A token's text is its own bytes: one token may hold half a character."""

from __future__ import annotations

import codecs
from collections.abc import Container
from functools import cached_property
from typing import Any

from engine.batch import SampledToken
from engine.token_bytes import is_byte_level, piece_bytes


class TokenText:
    """Token id -> (text, bytes), cached: the vocabulary is fixed for the life of the server. The entries hold no
    container (bytes, not a list of ints), so that the collector leaves them alone: a cache of SmolLM2's whole
    vocabulary as lists made a full collection take 5.6 ms."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._byte_level = is_byte_level(tokenizer.backend_tokenizer)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._compute(token_id)
        return cached

    @cached_property
    def num_added_to_text(self) -> tuple[int, int]:
        """How many special tokens the tokenizer puts before and after a text's own (Gemma's and Llama's BOS)."""
        plain = self._tokenizer.encode("a", add_special_tokens=False)
        full = self._tokenizer.encode("a", add_special_tokens=True)
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return start, len(full) - start - len(plain)
        return 0, 0

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id) or ""
        raw = piece_bytes(piece, self._byte_level)
        if raw is None:
            text = self._tokenizer.decode([token_id])
            return text, text.encode()
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            # OpenAI's spelling for a token that is not a whole character.
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def chat_logprobs(tokens: list[SampledToken], token_text: TokenText) -> dict[str, Any]:
    content = []
    for token in tokens:
        text, raw = token_text(token.token_id)
        top = [
            {"token": t, "logprob": lp, "bytes": list(b)}
            for t, b, lp in ((*token_text(tid), lp) for tid, lp in token.top_logprobs or [])
        ]
        content.append({"token": text, "logprob": token.logprob, "bytes": list(raw), "top_logprobs": top})
    return {"content": content}


class TextOffsets:
    """Character offsets of tokens in the completion text; a character split across tokens counts once."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0

    def next(self, raw: bytes) -> int:
        offset = self._chars
        self._chars += len(self._decoder.decode(raw))
        return offset


def completion_logprobs(
    tokens: list[SampledToken], token_text: TokenText, offsets: TextOffsets, unseen: Container[int] = ()
) -> dict[str, Any]:
    """unseen: the places of tokens the text does not show (an echoed prompt's BOS): no characters of it."""
    result: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, token in enumerate(tokens):
        text, raw = token_text(token.token_id)
        result["tokens"].append(text)
        result["token_logprobs"].append(token.logprob)
        top = token.top_logprobs
        if top is None:
            result["top_logprobs"].append(None)
        else:  # the sampled token always among them (OpenAI: "up to logprobs + 1 elements")
            choices = {token_text(tid)[0]: lp for tid, lp in top}
            if token.logprob is not None:
                choices.setdefault(text, token.logprob)
            result["top_logprobs"].append(choices)
        result["text_offset"].append(offsets.next(b"" if i in unseen else raw))
    return result
