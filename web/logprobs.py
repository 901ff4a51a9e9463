"""Logprobs in OpenAI's shapes. A token's text is its own bytes: one token may hold half a character."""

from __future__ import annotations

import codecs
import functools
import re
from typing import Any

from engine.batch import SampledToken

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenText:
    """Token id -> (text, bytes), cached: the vocabulary is fixed for the life of the server."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        decoder = getattr(tokenizer.backend_tokenizer, "decoder", None)
        self._byte_level = decoder is not None and "ByteLevel" in type(decoder).__name__ + repr(decoder)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._compute(token_id)
        return cached

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id) or ""
        raw = self._piece_bytes(piece)
        if raw is None:
            text = self._tokenizer.decode([token_id])
            return text, list(text.encode())
        try:
            return raw.decode("utf-8"), list(raw)
        except UnicodeDecodeError:
            # OpenAI's spelling for a token that is not a whole character.
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)

    def _piece_bytes(self, piece: str) -> bytes | None:
        if self._byte_level:
            alphabet = _byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            return None
        match = _BYTE_FALLBACK.match(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return None


def chat_logprobs(tokens: list[SampledToken], token_text: TokenText) -> dict[str, Any]:
    content = []
    for token in tokens:
        text, raw = token_text(token.token_id)
        top = [
            {"token": t, "logprob": lp, "bytes": b}
            for t, b, lp in ((*token_text(tid), lp) for tid, lp in token.top_logprobs or [])
        ]
        content.append({"token": text, "logprob": token.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


class TextOffsets:
    """Character offsets of tokens in the completion text; a character split across tokens counts once."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0

    def next(self, raw: list[int]) -> int:
        offset = self._chars
        self._chars += len(self._decoder.decode(bytes(raw)))
        return offset


def completion_logprobs(tokens: list[SampledToken], token_text: TokenText, offsets: TextOffsets) -> dict[str, Any]:
    result: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token in tokens:
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
        result["text_offset"].append(offsets.next(raw))
    return result
