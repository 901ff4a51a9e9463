"""Clients of a soak: well-behaved ones, ones that vanish mid-stream or never read, and bad input.

Each behaviour returns one Outcome, whatever happens (a timeout, a reset, a 5xx): nothing goes uncounted.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from bench.bad_input import BadRequest
from bench.client import RequestOptions, Target, build_body, endpoint_path, send_request
from bench.sse import SSEParser
from bench.workload import RequestSpec

# ok: what a good client wanted (or did: a disconnect); rejected / accepted: a bad request got a 4xx / a 200
# it may get; busy: 429; unexpected: another status that is not a 5xx; failed: 5xx, an error event or a
# stream without its end; reset: a transport error; timeout: no answer within the limit.
OUTCOMES = ("ok", "rejected", "accepted", "busy", "unexpected", "failed", "reset", "timeout")
FAILURES = frozenset({"failed", "reset", "timeout"})
NEVER_READ_RCVBUF = 4096


@dataclass(frozen=True)
class Outcome:
    kind: str
    outcome: str
    status: int | None = None
    seconds: float = 0.0
    detail: str | None = None


def require_loopback(url: str) -> tuple[str, int]:
    """(host, port) of a loopback URL; anything else is refused: these clients are hostile on purpose."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        is_loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        is_loopback = False
    if not is_loopback:
        raise SystemExit(f"bench: soak and abuse modes only run against loopback servers, not {host or url!r}")
    return host, parts.port or (443 if parts.scheme == "https" else 80)


async def _read_stream(response: httpx.Response, max_events: int | None = None) -> tuple[bool, str | None, int]:
    """(saw [DONE], error text, events read); stops after max_events content events when given."""
    parser = SSEParser()
    events = 0
    async for chunk in response.aiter_bytes():
        for event in parser.feed(chunk):
            if event.data == "[DONE]":
                return True, None, events
            try:
                data = json.loads(event.data)
            except json.JSONDecodeError:
                return False, f"unparsable event {event.data[:80]!r}", events
            if isinstance(data, dict) and data.get("error") is not None:
                return False, f"error event: {json.dumps(data['error'])[:160]}", events
            events += 1
            if max_events is not None and events >= max_events:
                return False, None, events
    return False, None, events


def _status_outcome(status: int, expected: frozenset[int]) -> str:
    if status == 429:
        return "busy"
    if status >= 500:
        return "failed"
    if status not in expected:
        return "unexpected"
    return "rejected" if 400 <= status < 500 else "accepted"


async def _timed(kind: str, timeout: float, body) -> Outcome:
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            outcome = await body()
    except TimeoutError:
        outcome = Outcome(kind, "timeout", detail=f"no answer within {timeout:g} s")
    except (httpx.HTTPError, OSError) as exc:
        outcome = Outcome(kind, "reset", detail=f"{type(exc).__name__}: {exc}"[:200])
    return Outcome(outcome.kind, outcome.outcome, outcome.status, time.perf_counter() - start, outcome.detail)


async def send_bad(client: httpx.AsyncClient, root: str, bad: BadRequest, timeout: float) -> Outcome:
    async def body() -> Outcome:
        headers = {"content-type": bad.content_type}
        async with client.stream("POST", root + bad.path, content=bad.body, headers=headers) as response:
            outcome = _status_outcome(response.status_code, bad.expected)
            detail = None
            if response.status_code == 200 and response.headers.get("content-type", "").startswith("text/event-stream"):
                done, error, _ = await _read_stream(response)
                if error or not done:
                    outcome, detail = "failed", error or "stream ended without [DONE]"
            else:
                text = (await response.aread()).decode("utf-8", errors="replace")
                if outcome != "accepted" or response.status_code != 200:
                    detail = f"HTTP {response.status_code}: {text[:160]}"
            return Outcome(bad.name, outcome, response.status_code, detail=detail)

    return await _timed(bad.name, timeout, body)


async def stream_full(client: httpx.AsyncClient, target: Target, spec: RequestSpec, options: RequestOptions) -> Outcome:
    start = time.perf_counter()
    result = await send_request(client, target, spec, options, start)
    if result.error is None:
        outcome = "ok"
    elif result.status is None:
        outcome = "timeout" if result.error.startswith("timed out") else "reset"
    elif result.status != 200:
        outcome = _status_outcome(result.status, frozenset())
    else:
        outcome = "failed"  # an error event, or a stream without its end
    return Outcome("stream", outcome, result.status, time.perf_counter() - start, result.error)


async def non_stream(client: httpx.AsyncClient, target: Target, spec: RequestSpec, options: RequestOptions) -> Outcome:
    async def body() -> Outcome:
        request = build_body(target, spec, options)
        request["stream"] = False
        request.pop("stream_options", None)
        response = await client.post(target.root + endpoint_path(options), json=request)
        if response.status_code != 200:
            return Outcome("non-stream", _status_outcome(response.status_code, frozenset()), response.status_code,
                           detail=response.text[:160])
        try:
            choices = response.json()["choices"]
            is_complete = bool(choices) and choices[0].get("finish_reason") is not None
        except (ValueError, KeyError, TypeError):
            is_complete = False
        return Outcome("non-stream", "ok" if is_complete else "failed", 200,
                       detail=None if is_complete else f"incomplete body {response.text[:120]!r}")

    return await _timed("non-stream", options.timeout, body)


async def disconnect_mid_stream(
    client: httpx.AsyncClient, target: Target, spec: RequestSpec, options: RequestOptions, after_events: int
) -> Outcome:
    """Reads `after_events` events, then closes the connection (httpx drops a connection whose body is unread)."""

    async def body() -> Outcome:
        url = target.root + endpoint_path(options)
        async with client.stream("POST", url, json=build_body(target, spec, options)) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", errors="replace")
                return Outcome("disconnect", _status_outcome(response.status_code, frozenset()), response.status_code,
                               detail=f"HTTP {response.status_code}: {text[:160]}")
            _, error, _ = await _read_stream(response, after_events)
            return Outcome("disconnect", "failed" if error else "ok", 200, detail=error)

    return await _timed("disconnect", options.timeout, body)


async def never_read(host: str, port: int, target: Target, spec: RequestSpec, options: RequestOptions,
                     hold_seconds: float) -> Outcome:
    """A streaming request on a socket with a tiny receive buffer that is not read for `hold_seconds`; then
    the status line is read (what the server answered) and the socket closed."""
    loop = asyncio.get_running_loop()

    async def body() -> Outcome:
        payload = json.dumps(build_body(target, spec, options)).encode()
        head = (f"POST {endpoint_path(options)} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nAccept: text/event-stream\r\n\r\n").encode()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, NEVER_READ_RCVBUF)
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1" if host == "localhost" else host, port))
            await loop.sock_sendall(sock, head + payload)
            await asyncio.sleep(hold_seconds)
            first = await loop.sock_recv(sock, 64)
        status_line = first.split(b"\r\n", 1)[0].decode("latin-1")
        try:
            status = int(status_line.split()[1])
        except (IndexError, ValueError):
            return Outcome("never-read", "reset", detail=f"no status line: {first[:40]!r}")
        if status == 200:
            return Outcome("never-read", "ok", status)
        return Outcome("never-read", _status_outcome(status, frozenset()), status, detail=f"{status_line}")

    return await _timed("never-read", hold_seconds + options.timeout, body)
