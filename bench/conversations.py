"""A conversation workload: many users share one long system prompt, each holds a multi-turn history, and their
turns interleave (every user sends its next turn as soon as its last answer ends). Reports, from the
server's own usage chunks, the prefix-cache hit rate (cached prompt tokens / prompt tokens), time to headers,
TTFT and throughput. Used by bench/cluster.py for each routing policy; pure client code."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.stats import percentile
from bench.words import WORDS


@dataclass(frozen=True)
class ConversationShape:
    num_users: int = 24
    num_turns: int = 6
    system_words: int = 256  # each word is about one token of SmolLM2's vocabulary
    user_words: int = 96
    answer_tokens: int = 48
    seed: int = 0
    # Seconds a user reads and types between an answer and its next turn (drawn uniformly from 0.5x to 1.5x, seeded).
    # 0: a closed loop, each turn sent the moment the last answer ends, so a server that answers sooner is sent
    # turns sooner and queues them, and TTFT then measures queueing as much as prefill.
    think_seconds: float = 0.0


@dataclass
class TurnResult:
    headers: float | None = None  # seconds from send to response headers
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class ConversationRun:
    seconds: float
    turns: list[TurnResult] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ok = [t for t in self.turns if t.error is None]
        prompt = sum(t.prompt_tokens for t in ok)
        cached = sum(t.cached_tokens for t in ok)
        ttfts = [t.ttft for t in ok if t.ttft is not None]
        headers = [t.headers for t in ok if t.headers is not None]
        return {
            "turns": len(self.turns),
            "errors": len(self.turns) - len(ok),
            "prefix_hit_rate": cached / prompt if prompt else 0.0,
            "ttft_p50": percentile(ttfts, 50),
            "ttft_p99": percentile(ttfts, 99),
            "headers_p99": percentile(headers, 99),
            "output_tok_s": sum(t.completion_tokens for t in ok) / self.seconds if self.seconds else 0.0,
            "seconds": self.seconds,
        }


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def _turn(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[TurnResult, str]:
    result, text = TurnResult(), []
    sent = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            result.headers = time.perf_counter() - sent
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}"
                await response.aread()
                return result, ""
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"].get("message", "error event")
                    continue
                for choice in event.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        result.ttft = result.ttft or time.perf_counter() - sent
                        text.append(piece)
                usage = event.get("usage")
                if usage:
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.completion_tokens = usage["completion_tokens"]
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        result.e2e = time.perf_counter() - sent
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"[:200]
    return result, "".join(text)


async def run_conversations(root: str, model: str | None, shape: ConversationShape, timeout: float = 1800.0) -> ConversationRun:
    """Every user's turns in order, all users at once; the same seed gives every server the same words."""
    rng = random.Random(shape.seed)
    system = "You are the assistant of a help desk. Follow these notes: " + _words(rng, shape.system_words)
    questions = [[_words(rng, shape.user_words) for _ in range(shape.num_turns)] for _ in range(shape.num_users)]
    run = ConversationRun(seconds=0.0)
    url = root.rstrip("/") + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=shape.num_users + 4, max_keepalive_connections=shape.num_users + 4)

    thinks = [[shape.think_seconds * rng.uniform(0.5, 1.5) for _ in range(shape.num_turns)]
              for _ in range(shape.num_users)]

    async def user(index: int, client: httpx.AsyncClient) -> None:
        messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        for turn, question in enumerate(questions[index]):
            if turn:
                await asyncio.sleep(thinks[index][turn])
            messages.append({"role": "user", "content": f"User {index}: {question}"})
            body: dict[str, Any] = {"messages": messages, "max_tokens": shape.answer_tokens, "temperature": 0,
                                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            if model:
                body["model"] = model
            result, answer = await _turn(client, url, body)
            run.turns.append(result)
            messages.append({"role": "assistant", "content": answer})

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async with asyncio.timeout(timeout):
            await asyncio.gather(*(user(i, client) for i in range(shape.num_users)))
    run.seconds = time.perf_counter() - start
    return run
