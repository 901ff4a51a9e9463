"""The server on the real default model (SmolLM2-135M-Instruct GGUF): parity and UTF-8 on the wire."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from engine.config import EngineConfig

from tests.support.server_harness import ThreadedServer, llm_engine_loader, stream_request

MODEL = "smollm2"
REPLACEMENT = "\ufffd"
CJK_QUESTION = "请用中文回答：你好吗？"
EMOJI_REQUEST = "Reply with three emoji: 😀"
MIXED_PROMPT = "日本語のテキストと中文文本和한국어 텍스트. 😀 🚀 🎉"


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    # Prefix caching off: in bfloat16 a prefix-cache hit can change a greedy result (reported to the engine),
    # and these tests compare the outputs of repeated requests.
    config = EngineConfig(model="", num_kv_blocks=256, max_num_seqs=16, enable_prefix_caching=False)
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def http(server: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def whole_characters_request(http: httpx.Client, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The request with the largest max_tokens (from body's) whose greedy output does not end inside a character:
    a length cut in the middle of a multi-token character is the one place the engine has to emit U+FFFD."""
    for max_tokens in range(body["max_tokens"], 0, -1):
        candidate = {**body, "max_tokens": max_tokens}
        choice = http.post(path, json=candidate).json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        if REPLACEMENT not in text:
            return candidate, text
    raise AssertionError("no clean output")


@pytest.mark.parametrize(
    "path,body,key",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": CJK_QUESTION}]}, "delta"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": EMOJI_REQUEST}]}, "delta"),
        ("/v1/completions", {"prompt": MIXED_PROMPT}, "text"),
    ],
)
def test_cjk_and_emoji_are_whole_in_every_chunk(http: httpx.Client, path: str, body: dict, key: str) -> None:
    body = {**body, "model": MODEL, "max_tokens": 12, "temperature": 0}
    request, full_text = whole_characters_request(http, path, body)
    assert any(ord(c) > 0x2E80 for c in full_text), f"expected CJK or emoji in {full_text!r}"
    result = stream_request(http, path, request)
    pieces = []
    for chunk in result.events[:-1]:
        if chunk["choices"]:
            piece = chunk["choices"][0]["delta"].get("content") if key == "delta" else chunk["choices"][0]["text"]
            assert REPLACEMENT not in (piece or ""), f"a split character in chunk {piece!r}"
            pieces.append(piece or "")
    assert "".join(pieces) == full_text


def test_streamed_equals_non_streamed_with_the_openai_client(server: ThreadedServer) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.prompt_tokens == len(server.engine.input_processor.encode_chat(messages))
