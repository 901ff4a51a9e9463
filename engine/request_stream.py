"""One accepted request's output, as its reader sees it: coalesced deltas, then exactly one finished delta.

The engine loop never waits on a reader. Deltas the reader has not taken yet are merged into one pending
delta, so a slow reader costs one delta's worth of memory (its unread tokens), not one object per step; the
loop's watchdog aborts a request whose output stays unread for longer than client_read_timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio

from engine.input_processor import PreparedRequest
from engine.outputs import FinishReason, RequestOutput


class RequestStream:
    """Iterate with `async for`; the last delta has finished=True. close() when the reader goes away."""

    def __init__(self, request: PreparedRequest) -> None:
        self.request = request
        self.arrival_time = time.perf_counter()
        self.admitted_time: float | None = None  # when the loop handed it to the scheduler
        self.unread_since: float | None = None  # monotonic time at which the pending delta appeared
        self.on_read_timeout: Callable[[], object] | None = None  # set by a reader that can be unblocked
        self._pending: RequestOutput | None = None
        self._ready = anyio.Event()
        self._num_output_tokens = 0
        self.is_finished = False  # the finished delta has been pushed
        self.is_closed = False  # the reader is gone
        self._is_drained = False  # the reader has taken the finished delta

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while self._pending is None:
            if self._is_drained or self.is_closed:
                raise StopAsyncIteration
            await self._ready.wait()
            self._ready = anyio.Event()
        output, self._pending, self.unread_since = self._pending, None, None
        self._is_drained = output.finished
        return output

    def close(self) -> None:
        """The reader is gone: later pushes fail (so the request is aborted) and nothing is kept."""
        self.is_closed = True
        self._pending = None
        self._ready.set()

    def push(self, output: RequestOutput) -> bool:
        """Hand a delta to the reader (merged with any it has not taken). False when the reader is gone."""
        if self.is_closed or self.is_finished:
            return not self.is_closed
        self._num_output_tokens = output.num_output_tokens or self._num_output_tokens
        self.is_finished = output.finished
        if self._pending is None:
            self._pending = output
            self.unread_since = time.monotonic()
        else:
            self._pending.absorb(output)
        self._ready.set()
        return True

    def end(self, reason: FinishReason, error: str | None = None) -> None:
        """Finish from outside the engine's deltas (abort, drain, a failed engine); no-op once finished."""
        final = RequestOutput(self.request_id, [], "", True, reason, error=error)
        final.num_prompt_tokens = self.num_prompt_tokens
        final.num_output_tokens = self._num_output_tokens
        self.push(final)
