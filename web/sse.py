"""Server-sent events: one accepted request's deltas as OpenAI stream chunks, ending in `data: [DONE]`."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from quart import Response

from engine.outputs import FinishReason
from engine.request_stream import RequestStream
from web.errors import error_body
from web.json_response import dumps
from web.metrics import RequestTimer
from web.responses import ResponseFormat, Usage

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: Any) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


def engine_error_event(message: str) -> bytes:
    return sse_event(error_body(500, message, code="engine_error"))


async def stream_events(
    stream: RequestStream, fmt: ResponseFormat, timer: RequestTimer, abort: Callable[[str], bool]
) -> AsyncIterator[bytes]:
    """Exactly one terminal event (a finish chunk or an error event), then [DONE], on every path that the
    client is still there to see. A client that leaves is aborted in `finally` (CancelledError at an await,
    GeneratorExit at a yield); the exception then propagates."""
    usage = Usage(prompt_tokens=stream.num_prompt_tokens)
    # A client that stops reading blocks this task in a socket write; the engine's watchdog aborts the
    # request after client_read_timeout and cancels the task, which closes the connection.
    current = asyncio.current_task()
    stream.on_read_timeout = current.cancel if current is not None else None
    num_open = stream.num_choices  # each choice ends with its own finish chunk; the stream after the last
    try:
        for chunk in fmt.opening_chunks(stream.num_choices):
            yield sse_event(chunk)
        async for output in stream:
            timer.observe(output)
            usage.absorb(output)
            if output.finish_reason is FinishReason.ERROR:
                yield engine_error_event(output.error or "the engine failed")
                break
            for chunk in fmt.delta_chunks(output):
                yield sse_event(chunk)
            if output.finished:
                yield sse_event(fmt.finish_chunk(output.finish_reason or FinishReason.STOP, output.index))
                num_open -= 1
                if not num_open:
                    if fmt.include_usage:
                        yield sse_event(fmt.usage_chunk(usage))
                    break
        else:
            timer.end(FinishReason.ERROR)
            yield engine_error_event("the request ended without a result")
        yield DONE
    finally:
        stream.close()
        abort(stream.request_id)
        if not timer.ended:  # the client left, or was cut off for not reading
            timer.end(FinishReason.ABORT)


def _abort_soon(loop: asyncio.AbstractEventLoop, abort: Callable[[str], bool], request_id: str) -> None:
    try:
        loop.call_soon_threadsafe(abort, request_id)
    except RuntimeError:  # the loop is closed: the server, and the request with it, are gone
        pass


def sse_response(
    stream: RequestStream, fmt: ResponseFormat, timer: RequestTimer, abort: Callable[[str], bool]
) -> Response:
    return event_stream_response(stream_events(stream, fmt, timer, abort), stream.request_id, abort)


def event_stream_response(events: AsyncIterator[bytes], request_id: str, abort: Callable[[str], bool]) -> Response:
    """A streamed response of one request's events; `events` aborts the request in its own `finally`."""
    # If the client leaves before Quart starts iterating, the generator's `finally` never runs: abort when
    # it is collected instead, on the event-loop thread (the collector may run in the forward-pass thread).
    loop = asyncio.get_running_loop()
    on_collect = weakref.finalize(events, _abort_soon, loop, abort, request_id)
    on_collect.atexit = False
    response = Response(events, status=200, content_type="text/event-stream", headers=SSE_HEADERS)
    response.timeout = None  # Quart's RESPONSE_TIMEOUT would cut a long stream silently
    return response
