"""One streamed request (httpx), timed from send to headers, first token, every token and the end."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.sse import SSEEvent, SSEParser
from bench.workload import RequestSpec

FLAVORS = ("openai", "sluice", "transformers")
# llama-server (cpp-httplib) closes idle keep-alive connections after 5 s; a request written into one as it
# closes gets no response at all, and nothing was processed: such a request is sent once more.
KEEPALIVE_RETRIES = 1


@dataclass(frozen=True)
class Target:
    """A server to measure. The flavor only decides how a fixed output length is asked for."""

    name: str
    base_url: str
    model: str | None = None
    flavor: str = "openai"
    api_key: str | None = None  # sent as a bearer token

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def root(self) -> str:
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass(frozen=True)
class RequestOptions:
    endpoint: str = "chat"  # "chat" | "completions"
    temperature: float = 0.0
    ignore_eos: bool = True
    include_usage: bool = True
    timeout: float = 600.0


@dataclass
class RequestResult:
    index: int
    start: float  # seconds since the level started
    status: int | None = None  # HTTP status; None when no response arrived
    # Request fully written -> response headers (s), 429s included. It leaves out the load generator's own
    # queueing: in a burst of hundreds, starting every request takes the client's event loop most of a second.
    admission: float | None = None
    client_queue: float | None = None  # the send call -> request fully written (connect included)
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    content_events: int = 0
    usage_reported: bool = False
    finish_reason: str | None = None
    error: str | None = None
    retried: bool = False  # sent again once: the server had closed the reused keep-alive connection unanswered

    @property
    def outcome(self) -> str:
        if self.status == 429:
            return "429"
        return "error" if self.error is not None else "ok"


def build_body(target: Target, spec: RequestSpec, options: RequestOptions) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": spec.max_tokens, "temperature": options.temperature, "stream": True}
    if options.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if target.model is not None:
        body["model"] = target.model
    if options.include_usage:
        body["stream_options"] = {"include_usage": True}
    if options.ignore_eos:
        if target.flavor == "transformers":
            # transformers serve rejects unknown fields; a generation_config without eos_token_id never stops early.
            config = {"max_new_tokens": spec.max_tokens, "do_sample": options.temperature > 0}
            body["generation_config"] = json.dumps(config)
        else:
            body["ignore_eos"] = True  # Sluice, vLLM and llama.cpp's server all accept it
    return body


def endpoint_path(options: RequestOptions) -> str:
    return "/v1/chat/completions" if options.endpoint == "chat" else "/v1/completions"


class _StreamState:
    """Folds parsed SSE events into a RequestResult."""

    def __init__(self, result: RequestResult, sent: float) -> None:
        self.result = result
        self.sent = sent
        self.last_token: float | None = None
        self.done = False

    def on_event(self, event: SSEEvent, now: float) -> None:
        if event.data == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(event.data)
        except json.JSONDecodeError:
            self.result.error = f"unparsable event: {event.data[:120]!r}"
            return
        if not isinstance(chunk, dict):
            return
        if chunk.get("error") is not None:
            self.result.error = f"error event: {json.dumps(chunk['error'])[:200]}"
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.result.usage_reported = True
            self.result.prompt_tokens = usage.get("prompt_tokens")
            self.result.completion_tokens = usage.get("completion_tokens") or 0
        for choice in chunk.get("choices") or []:
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if text:
                self._on_token(now)
            if choice.get("finish_reason"):
                self.result.finish_reason = choice["finish_reason"]

    def _on_token(self, now: float) -> None:
        result = self.result
        if self.last_token is None:
            result.ttft = now - self.sent
        else:
            result.itl.append(now - self.last_token)
        self.last_token = now
        result.content_events += 1

    def finish(self, now: float) -> None:
        result = self.result
        result.e2e = now - self.sent
        if not result.usage_reported:
            result.completion_tokens = result.content_events  # one event per token is the common case
        if result.error is None and result.finish_reason is None and not self.done:
            result.error = "stream ended without a finish_reason or [DONE]"
        elif result.error is None and result.finish_reason in ("abort", "error"):
            result.error = f"finish_reason {result.finish_reason}"


async def _read_response(response: httpx.Response, result: RequestResult, state: _StreamState, sent: float,
                         written: float) -> None:
    """`written`: when the request's last byte left (the trace hook; the send call for a mock transport)."""
    headers = time.perf_counter()
    result.admission, result.client_queue = headers - written, written - sent
    result.status = response.status_code
    if response.status_code != 200:
        text = (await response.aread()).decode("utf-8", errors="replace")
        result.error = f"HTTP {response.status_code}: {text[:200]}"
        result.e2e = time.perf_counter() - sent
        return
    parser = SSEParser()
    async for chunk in response.aiter_bytes():
        now = time.perf_counter()
        for event in parser.feed(chunk):
            state.on_event(event, now)
    now = time.perf_counter()
    for event in parser.close():
        state.on_event(event, now)
    state.finish(now)


async def send_request(
    client: httpx.AsyncClient, target: Target, spec: RequestSpec, options: RequestOptions, level_start: float
) -> RequestResult:
    sent = time.perf_counter()
    result = RequestResult(index=spec.index, start=sent - level_start)
    state = _StreamState(result, sent)
    body = build_body(target, spec, options)
    written: list[float] = []

    async def trace(event: str, info: dict) -> None:
        if event == "http11.send_request_body.complete":
            written.append(time.perf_counter())

    try:
        async with asyncio.timeout(options.timeout):
            url = target.root + endpoint_path(options)
            for attempt in range(1 + KEEPALIVE_RETRIES):
                try:
                    async with client.stream("POST", url, json=body, headers=target.headers,
                                             extensions={"trace": trace}) as response:
                        await _read_response(response, result, state, sent, written[-1] if written else sent)
                    break
                except httpx.RemoteProtocolError:
                    if result.status is not None or attempt == KEEPALIVE_RETRIES:
                        raise
                    result.retried = True  # the server closed an idle keep-alive connection as we reused it
    except TimeoutError:
        result.error = f"timed out after {options.timeout:g} s"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    return result


async def sample_health(client: httpx.AsyncClient, target: Target, interval: float, out: list[float]) -> None:
    """Polls GET /health until cancelled, appending each latency (s): the server's event-loop responsiveness."""
    while True:
        start = time.perf_counter()
        try:
            response = await client.get(target.root + "/health")
            await response.aread()
        except httpx.HTTPError:
            await asyncio.sleep(interval)
            continue
        if response.status_code in (404, 405) and not out:
            return  # no /health on this server: record nothing
        out.append(time.perf_counter() - start)
        await asyncio.sleep(interval)


async def discover_model(client: httpx.AsyncClient, target: Target) -> str | None:
    """The first model id of GET /v1/models, or None (the request then names no model)."""
    try:
        response = await client.get(target.root + "/v1/models", headers=target.headers)
        data = response.json().get("data") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return data[0].get("id") if data else None
