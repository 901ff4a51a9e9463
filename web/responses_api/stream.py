"""A response's events as server-sent events (`event: <type>` and `data: <json>`, no [DONE]): the opening events
at once, the deltas as the engine makes them, exactly one terminal event on every path that the client is
still there to see. A client that leaves closes the output stream, which aborts the request (its KV freed by
the loop between steps)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, nullcontext

from engine.outputs import FinishReason
from engine.request import OutputStream
from web.json_response import dumps_one_line
from web.metrics import RequestTimer
from web.responses_api.output import Event, ResponseBuilder, usage_object
from web.responses import Usage
from web.sse import BROKEN_STREAM

logger = logging.getLogger(__name__)


def encode_events(events: list[Event]) -> bytes:
    return b"".join(
        b"event: " + event["type"].encode() + b"\ndata: " + dumps_one_line(event) + b"\n\n" for event in events
    )


async def response_events(
    outputs: OutputStream,
    builder: ResponseBuilder,
    timer: RequestTimer,
    on_finished: Callable[[ResponseBuilder], None],
    in_progress: AbstractContextManager[object] = nullcontext(),
) -> AsyncIterator[bytes]:
    """on_finished: called with the finished response before its terminal event is sent (the store keeps it
    then, so that a client acting on the terminal event finds it). in_progress: entered once the stream starts
    and left when it ends, on every path (the store shows the response in progress meanwhile)."""
    # A client that stops reading blocks this task in a socket write; the engine's watchdog aborts the
    # request after client_read_timeout and cancels the task, which closes the connection.
    current = asyncio.current_task()
    outputs.request.on_read_timeout = current.cancel if current is not None else None
    try:
        async with outputs:
            with in_progress:
                yield encode_events(builder.start())
                reason, error, error_code = FinishReason.ERROR, "the request ended without a result", None
                async for output in outputs:
                    timer.observe(output)
                    events = builder.feed(output.text_delta, output.new_token_ids)
                    if output.finished:
                        reason, error = output.finish_reason or FinishReason.ERROR, output.error
                        error_code = output.error_code
                        break
                    if events:
                        yield encode_events(events)
                else:
                    events = []
                    timer.end(FinishReason.ERROR)
                usage = Usage.of_request(outputs.request)
                events += builder.finish(reason, error, usage_object(usage.prompt_tokens, usage.completion_tokens,
                                                                     usage.cached_tokens, builder.num_reasoning_tokens),
                                         error_code)  # fmt: skip
                on_finished(builder)
                yield encode_events(events)
    except Exception:  # not the client leaving (BaseException): the stream still ends with one terminal event
        logger.exception("a response's stream failed while it was written")
        timer.end(FinishReason.ERROR)
        yield encode_events([builder.failure_event(BROKEN_STREAM)])
    finally:
        if not timer.ended:  # the client left, or was cut off for not reading
            timer.end(FinishReason.ABORT)
