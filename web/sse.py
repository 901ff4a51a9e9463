"""Server-sent events: one accepted request's deltas as OpenAI stream chunks, ending in `data: [DONE]`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from quart import Response

from engine.outputs import FinishReason, RequestOutput
from engine.request import OutputStream
from web.errors import error_body, failure_of
from web.json_response import dumps_one_line
from web.metrics import RequestTimer
from web.responses import ResponseFormat, Usage

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
# What a stream whose writing failed ends with: a bug of this server (the engine's failures arrive as outputs), told
# as the non-streamed answer's 500 is (web/errors.py), with no detail of it.
BROKEN_STREAM = "internal server error while writing the stream"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: Any) -> bytes:
    return b"data: " + dumps_one_line(payload) + b"\n\n"


def engine_error_event(message: str) -> bytes:
    return sse_event(error_body(500, message, code="engine_error"))


def error_event(output: RequestOutput) -> bytes:
    """A choice that ended in an error: the request's own (400, its code) or the engine's (500)."""
    return sse_event(failure_of(output).body())


async def stream_events(outputs: OutputStream, fmt: ResponseFormat, timer: RequestTimer) -> AsyncIterator[bytes]:
    """Exactly one terminal event (a finish chunk or an error event), then [DONE], on every path that the
    client is still there to see. A client that leaves (CancelledError at an await, GeneratorExit at a yield)
    closes the output stream, which aborts the request; the exception then propagates."""
    # A client that stops reading blocks this task in a socket write; the engine's watchdog aborts the
    # request after client_read_timeout and cancels the task, which closes the connection.
    current = asyncio.current_task()
    outputs.request.on_read_timeout = current.cancel if current is not None else None
    num_open = outputs.request.num_choices  # a finish chunk per choice; the stream ends after the last
    # The events of one output leave in one write (the last token's delta, its finish chunk, the usage and [DONE]
    # together): each write is a trip through Hypercorn and a send call on the event loop, which 64 streams share.
    try:
        async with outputs:
            if fmt.continuous_usage:
                fmt.usage_now(Usage(outputs.request.num_prompt_tokens))
            for chunk in fmt.opening_chunks(outputs.request.num_choices):
                yield sse_event(chunk)
            async for output in outputs:
                timer.observe(output)
                if output.finish_reason is FinishReason.ERROR:
                    last = error_event(output)
                    break
                if fmt.continuous_usage:
                    fmt.usage_now(Usage.of_output(output))
                events = [sse_event(chunk) for chunk in fmt.delta_chunks(output)]
                if output.finished:
                    reason = output.finish_reason or FinishReason.STOP
                    events.append(sse_event(fmt.finish_chunk(reason, output.index, output.stop_reason)))
                    num_open -= 1
                    if not num_open:
                        if fmt.include_usage:
                            events.append(sse_event(fmt.usage_chunk(Usage.of_request(outputs.request))))
                        last = b"".join(events)
                        break
                if events:
                    yield b"".join(events)
            else:
                timer.end(FinishReason.ERROR)
                last = engine_error_event("the request ended without a result")
            yield last + DONE
    except Exception:  # not the client leaving (BaseException): the stream still ends as promised
        logger.exception("a stream failed while it was written")
        timer.end(FinishReason.ERROR)
        yield engine_error_event(BROKEN_STREAM) + DONE
    finally:
        if not timer.ended:  # the client left, or was cut off for not reading
            timer.end(FinishReason.ABORT)


async def stream_batch_events(
    streams: list[OutputStream], fmt: ResponseFormat, timers: list[RequestTimer]
) -> AsyncIterator[bytes]:
    """A list of completion prompts in one stream, as OpenAI streams them: prompt p's choice i is index p * n + i,
    the usage chunk counts every prompt. stream_events' promises hold: one terminal event per choice (or one
    error event), then [DONE]; a client that leaves aborts every prompt's request."""
    current = asyncio.current_task()
    arrivals: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()
    # A reader takes its prompt's next delta only once the last one was taken from `arrivals`: while the client is
    # not reading, the rest stay in the prompt's request, merged and seen unread by the watchdog (a reader that took
    # them all queued one delta per step here, and its requests ran to max_tokens past client_read_timeout).
    taken = [asyncio.Event() for _ in streams]

    async def read(p: int) -> None:  # one task per prompt: its deltas, then None
        try:
            async for output in streams[p]:
                taken[p].clear()
                arrivals.put_nowait((p, output))
                await taken[p].wait()
        finally:
            arrivals.put_nowait((p, None))

    n = streams[0].request.num_choices
    num_open = [n] * len(streams)  # per prompt, its choices without a finish chunk yet
    readers: list[asyncio.Task] = []
    try:
        for stream in streams:
            stream.request.on_read_timeout = current.cancel if current is not None else None
        readers = [asyncio.create_task(read(p)) for p in range(len(streams))]
        for chunk in fmt.opening_chunks(n * len(streams)):
            yield sse_event(chunk)
        while True:
            p, output = await arrivals.get()
            taken[p].set()
            if output is None:
                if num_open[p]:  # that prompt's stream ended before its choices did
                    timers[p].end(FinishReason.ERROR)
                    last = engine_error_event("the request ended without a result")
                    break
                continue
            timers[p].observe(output)
            if output.finish_reason is FinishReason.ERROR:
                last = error_event(output)
                break
            if fmt.continuous_usage:
                fmt.usage_now(Usage.of_output(output))
            output.index += p * n
            events = [sse_event(chunk) for chunk in fmt.delta_chunks(output)]
            if output.finished:
                events.append(sse_event(fmt.finish_chunk(output.finish_reason or FinishReason.STOP, output.index,
                                                         output.stop_reason)))  # fmt: skip
                num_open[p] -= 1
                if not any(num_open):
                    if fmt.include_usage:
                        usage = Usage.total([Usage.of_request(s.request) for s in streams])
                        events.append(sse_event(fmt.usage_chunk(usage)))
                    last = b"".join(events)
                    break
            if events:
                yield b"".join(events)
        yield last + DONE
    except Exception:  # not the client leaving (BaseException): the stream still ends as promised
        logger.exception("a stream failed while it was written")
        for timer in timers:
            timer.end(FinishReason.ERROR)  # (a timer ends once: the prompts that finished keep their reason)
        yield engine_error_event(BROKEN_STREAM) + DONE
    finally:
        for reader in readers:
            reader.cancel()
        for stream, timer in zip(streams, timers):
            stream.close()  # aborts a request still running (the client left, or another prompt failed)
            if not timer.ended:
                timer.end(FinishReason.ABORT)


def sse_response(outputs: OutputStream, fmt: ResponseFormat, timer: RequestTimer) -> Response:
    return event_stream_response(stream_events(outputs, fmt, timer))


def event_stream_response(events: AsyncIterator[bytes]) -> Response:
    """A streamed response of one request's events. A client that leaves before Quart starts iterating leaves
    the generator unstarted: collected with it, the request's output stream aborts the request."""
    response = Response(events, status=200, content_type="text/event-stream", headers=SSE_HEADERS)
    response.timeout = None  # Quart's RESPONSE_TIMEOUT would cut a long stream silently
    return response
