"""One accepted request's output, as its reader sees it: coalesced deltas, then exactly one finished delta per
choice (n of them with SamplingParams.n; the stream ends after the last).

The engine loop never waits on a reader. Deltas the reader has not taken yet are merged into one pending
delta per choice, so a slow reader costs n deltas' worth of memory (its unread tokens), not one object per
step; the loop's watchdog aborts a request whose output stays unread for longer than client_read_timeout.
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
        self.num_choices = request.params.n
        self._pending: dict[int, RequestOutput] = {}  # choice index -> its unread delta, oldest first
        self._ready = anyio.Event()
        self._num_output_tokens = [0] * self.num_choices
        self._finished_choices: set[int] = set()  # choices whose finished delta has been pushed
        self.is_finished = False  # every choice's finished delta has been pushed
        self.is_closed = False  # the reader is gone
        self._num_drained = 0  # finished deltas the reader has taken

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._pending:
            if self._num_drained == self.num_choices or self.is_closed:
                raise StopAsyncIteration
            await self._ready.wait()
            self._ready = anyio.Event()
        output = self._pending.pop(next(iter(self._pending)))
        # A reader that takes a delta is reading: the clock restarts for what is left.
        self.unread_since = time.monotonic() if self._pending else None
        self._num_drained += output.finished
        return output

    def close(self) -> None:
        """The reader is gone: later pushes fail (so the request is aborted) and nothing is kept."""
        self.is_closed = True
        self._pending = {}
        self._ready.set()

    def push(self, output: RequestOutput) -> bool:
        """Hand a delta to the reader (merged with any it has not taken). False when the reader is gone."""
        index = output.index
        if self.is_closed or self.is_finished or index in self._finished_choices:
            return not self.is_closed
        self._num_output_tokens[index] = output.num_output_tokens or self._num_output_tokens[index]
        if output.finished:
            self._finished_choices.add(index)
            self.is_finished = len(self._finished_choices) == self.num_choices
        pending = self._pending.get(index)
        if pending is None:
            self._pending[index] = output
            if self.unread_since is None:
                self.unread_since = time.monotonic()
        else:
            pending.absorb(output)
        self._ready.set()
        return True

    def end(self, reason: FinishReason, error: str | None = None) -> None:
        """Finish every unfinished choice from outside the engine's deltas (abort, drain, a failed engine)."""
        for index in range(self.num_choices):
            if index not in self._finished_choices:
                final = RequestOutput(self.request_id, [], "", True, reason, error=error, index=index)
                final.num_prompt_tokens = self.num_prompt_tokens
                final.num_output_tokens = self._num_output_tokens[index]
                self.push(final)
