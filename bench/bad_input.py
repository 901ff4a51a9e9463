"""Requests a hostile or broken client sends: malformed, oversized, extreme. Each must get a clear answer.

Bodies are built once (some are megabytes) and sent many times. `expected` is the set of statuses that
count as a right answer; anything else is reported, and a 5xx, a reset or a timeout is a failure.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from bench.words import WORDS

MIB = 1 << 20
OVERSIZED_BODY_BYTES = 8 * MIB  # above Sluice's default max_body_bytes (4 MiB): 413
LARGE_TEXT_BYTES = 3 * MIB  # below it: megabytes of text that reach the prompt checks
NUM_TOKEN_IDS = 900_000  # "1," each: ~1.8 MB of JSON, far beyond any context
NUM_STOP_STRINGS = 5_000
STOP_STRING_CHARS = 40
REJECTED = frozenset({400, 404, 413, 415, 422})
ACCEPTED_OR_REJECTED = REJECTED | {200}


@dataclass(frozen=True)
class BadRequest:
    name: str
    path: str
    body: bytes
    content_type: str = "application/json"
    expected: frozenset[int] = REJECTED
    is_heavy: bool = False  # megabytes: sent less often in a soak


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _text(num_bytes: int, rng: random.Random) -> str:
    words: list[str] = []
    size = 0
    while size < num_bytes:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


# Values the schema accepts but that round to zero, overflow or sit at a range's edge in float32/bf16.
EXTREME_SAMPLING: tuple[dict[str, Any], ...] = (
    {"temperature": 1e-45, "top_p": 1e-45},
    {"temperature": 5e-324, "top_k": 1},
    {"temperature": 2.0, "top_p": 1.0, "min_p": 1.0},
    {"temperature": 1e-38, "min_p": 1e-45, "repetition_penalty": 1e-45},
    {"temperature": 1.0, "repetition_penalty": 1e38, "frequency_penalty": 2.0, "presence_penalty": -2.0},
    {"temperature": 1.0, "top_k": 2**31 - 1, "top_p": 5e-324, "seed": 2**63 - 1},
    {"temperature": 0.7, "seed": -(2**63), "min_p": 0.9999999},
)


def catalogue(model: str, seed: int = 0) -> list[BadRequest]:
    rng = random.Random(seed)
    chat = "/v1/chat/completions"
    completions = "/v1/completions"
    user = [{"role": "user", "content": "Say something."}]
    stops = ["".join(rng.choice("abcdefghij") for _ in range(STOP_STRING_CHARS)) for _ in range(NUM_STOP_STRINGS)]
    requests = [
        BadRequest("garbage-json", chat, b'{"model": "' + model.encode() + b'", "messages": [{"role": '),
        BadRequest("not-json", chat, b"hello, server", content_type="text/plain"),
        BadRequest("empty-body", chat, b""),
        BadRequest("json-not-object", chat, b"[1, 2, 3]"),
        BadRequest("wrong-types", chat, _json({"model": model, "messages": "hi", "temperature": "hot"})),
        BadRequest("unknown-model", chat, _json({"model": "no-such-model", "messages": user, "max_tokens": 4}),
                   expected=frozenset({404, 400})),
        BadRequest("unknown-route", "/v1/no-such-route", _json({"model": model}), expected=frozenset({404, 405})),
        BadRequest("negative-max-tokens", chat, _json({"model": model, "messages": user, "max_tokens": -1})),
        BadRequest("min-tokens-beyond-context", completions,
                   _json({"model": model, "prompt": "Hello", "max_tokens": 8, "min_tokens": 10**7})),
        BadRequest("huge-stop-list", completions,
                   _json({"model": model, "prompt": "Hello", "max_tokens": 8, "stop": stops}),
                   expected=frozenset({400, 413})),
        BadRequest("oversized-body", completions,
                   _json({"model": model, "prompt": _text(OVERSIZED_BODY_BYTES, rng), "max_tokens": 1}),
                   expected=frozenset({413}), is_heavy=True),
        BadRequest("megabytes-of-text", completions,
                   _json({"model": model, "prompt": _text(LARGE_TEXT_BYTES, rng), "max_tokens": 1}),
                   expected=frozenset({400, 413}), is_heavy=True),
        BadRequest("million-token-ids", completions,
                   _json({"model": model, "prompt": [1] * NUM_TOKEN_IDS, "max_tokens": 1}),
                   expected=frozenset({400, 413}), is_heavy=True),
    ]
    for i, values in enumerate(EXTREME_SAMPLING):
        stream = i % 2 == 0
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 8, "stream": stream, **values}
        requests.append(BadRequest(f"extreme-sampling-{i}", completions, _json(body), expected=ACCEPTED_OR_REJECTED))
    return requests
