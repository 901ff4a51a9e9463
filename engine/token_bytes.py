"""A token's own bytes, where its piece spells them: GPT-2's byte-level alphabet, or SentencePiece's byte fallback
(`<0xE6>`). One token may hold part of a character; None where the piece does not say (a plain SentencePiece
word, an added token)."""

from __future__ import annotations

import functools
import re
from typing import Any

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


def is_byte_level(backend: Any) -> bool:
    """backend: a `tokenizers.Tokenizer` (a transformers tokenizer's backend_tokenizer)."""
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in type(decoder).__name__ + repr(decoder)


def piece_bytes(piece: str, byte_level: bool) -> bytes | None:
    if byte_level:
        alphabet = _byte_level_alphabet()
        return bytes(alphabet[c] for c in piece) if all(c in alphabet for c in piece) else None
    match = _BYTE_FALLBACK.match(piece)
    return bytes([int(match.group(1), 16)]) if match else None
