"""One request in the async engine, from its admission slot to its last output: its state, its choices' progress
and its output stream. `OutputStream` is what its reader holds.

The lifecycle, moved only by the async engine on the event-loop thread:

    PREPARING --bind()--> QUEUED --start()--> RUNNING --its last choice ends--> FINISHED
        |                    |                                                     ^
        | (slot given back)  +----------- end(reason): abort, drain, engine failure +

- PREPARING: an admission slot held by a Reservation while the prompt is tokenized and checked.
- QUEUED: prepared and accepted (it holds its admission slot), waiting for room in the scheduler.
- RUNNING: handed to the LLMEngine; its choices produce deltas.
- FINISHED: every choice has its FinishReason (`finish_reasons`), from the engine's deltas or from end().

The reader's contract (OutputStream, what AsyncEngine.generate() returns):
- `async for output in stream` yields RequestOutput deltas; every choice (index 0 .. n-1) ends with exactly one
  delta with finished=True, and the iteration ends after the last.
- Deltas the reader has not taken yet are merged into one pending delta per choice (RequestOutput.absorb), so a
  slow reader costs its unread tokens, not an object per step; the engine never waits on a reader.
- Closing the stream aborts the request if it is unfinished: close() / aclose(), leaving `async with stream`, a
  cancelled read (the reading task was cancelled), or the stream being garbage-collected unread. The reader never
  calls the engine's abort itself; closing twice, or after the end, does nothing.
"""

from __future__ import annotations

import enum
import logging
import time
import weakref
from collections.abc import Callable, Iterable

import anyio

from engine.input_processor import PreparedRequest
from engine.outputs import FinishReason, RequestOutput

logger = logging.getLogger(__name__)


class RequestState(enum.Enum):
    PREPARING = "preparing"
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(self) -> None:
        self.state = RequestState.PREPARING
        self._prepared: PreparedRequest | None = None
        self.arrival_time = 0.0  # perf_counter when it was queued
        self.admitted_time: float | None = None  # perf_counter when the loop handed it to the scheduler
        self.is_in_engine = False  # the LLMEngine holds it: only the loop may free it, between steps
        self.finish_reasons: list[FinishReason | None] = []  # per choice, set as each one ends
        self._num_output_tokens: list[int] = []  # per choice, as its last delta said
        self._num_cached_tokens = 0
        # The output stream.
        self._unread: dict[int, RequestOutput] = {}  # choice index -> its unread delta, oldest first
        self._ready = anyio.Event()
        self._num_finals_taken = 0
        self.unread_since: float | None = None  # monotonic time at which the oldest unread delta appeared
        self.on_read_timeout: Callable[[], object] | None = None  # set by a reader that can be unblocked
        self.is_reader_gone = False

    # ---- the state machine ---------------------------------------------------------------------------
    @property
    def prepared(self) -> PreparedRequest:
        if self._prepared is None:
            raise RuntimeError("the request is still being prepared")
        return self._prepared

    @property
    def request_id(self) -> str:
        return self.prepared.request_id

    @property
    def num_choices(self) -> int:
        return self.prepared.params.n

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prepared.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens of every choice so far."""
        return sum(self._num_output_tokens)

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached_tokens

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def bind(self, prepared: PreparedRequest) -> None:
        self._move(RequestState.PREPARING, RequestState.QUEUED)
        self._prepared = prepared
        self.arrival_time = time.perf_counter()
        self.finish_reasons = [None] * prepared.params.n
        self._num_output_tokens = [0] * prepared.params.n

    def start(self) -> None:
        self._move(RequestState.QUEUED, RequestState.RUNNING)
        self.is_in_engine = True
        self.admitted_time = time.perf_counter()

    def push(self, output: RequestOutput) -> bool:
        """An engine delta for the reader (merged with any it has not taken). False when the reader is gone."""
        index = output.index
        if self.finish_reasons[index] is not None:
            return not self.is_reader_gone
        self._num_output_tokens[index] = output.num_output_tokens or self._num_output_tokens[index]
        self._num_cached_tokens = max(self._num_cached_tokens, output.num_cached_tokens)
        if output.finished:
            self.finish_reasons[index] = output.finish_reason or FinishReason.ABORT
            if all(reason is not None for reason in self.finish_reasons):
                self.state = RequestState.FINISHED
        if self.is_reader_gone:
            return False
        pending = self._unread.get(index)
        if pending is None:
            self._unread[index] = output
            if self.unread_since is None:
                self.unread_since = time.monotonic()
        else:
            pending.absorb(output)
        self._ready.set()
        return True

    def end(self, reason: FinishReason, error: str | None = None, error_code: str | None = None) -> None:
        """Finish every unfinished choice from outside the engine's deltas (abort, drain, a failed engine)."""
        for index, finished in enumerate(self.finish_reasons):
            if finished is None:
                final = RequestOutput(self.request_id, [], "", True, reason, error=error, error_code=error_code,
                                      index=index)  # fmt: skip
                final.num_prompt_tokens = self.num_prompt_tokens
                final.num_output_tokens = self._num_output_tokens[index]
                final.num_cached_tokens = self._num_cached_tokens
                self.push(final)

    def _move(self, source: RequestState, target: RequestState) -> None:
        if self.state is not source:
            raise RuntimeError(f"a {self.state.value} request cannot become {target.value}")
        self.state = target

    # ---- the reader's side ---------------------------------------------------------------------------
    async def next_output(self) -> RequestOutput | None:
        """The next (merged) delta; None once every choice's final delta has been taken or the reader left."""
        while not self._unread:
            if self._num_finals_taken == len(self.finish_reasons) or self.is_reader_gone:
                return None
            await self._ready.wait()
            self._ready = anyio.Event()
        output = self._unread.pop(next(iter(self._unread)))
        # A reader that takes a delta is reading: the clock restarts for what is left.
        self.unread_since = time.monotonic() if self._unread else None
        self._num_finals_taken += output.finished
        return output

    def leave(self) -> None:
        """The reader is gone: later pushes fail (so the request is aborted) and nothing is kept."""
        self.is_reader_gone = True
        self._unread = {}
        self._ready.set()


def abort_abandoned(requests: Iterable[Request], client_read_timeout: float, abort: Callable[[str], object]) -> None:
    """The engine's watchdog: abort the requests whose reader is gone (its OutputStream collected unclosed) or
    has left output unread for longer than client_read_timeout (and call that one's on_read_timeout)."""
    now = time.monotonic()
    for request in list(requests):
        if request.is_reader_gone:
            abort(request.request_id)
        elif request.unread_since is not None and now - request.unread_since > client_read_timeout:
            logger.info("request %s: output unread for %.0f s; aborting it", request.request_id,
                        now - request.unread_since)  # fmt: skip
            abort(request.request_id)
            if request.on_read_timeout is not None:
                request.on_read_timeout()


def _reader_collected(request: Request) -> None:
    # May run in any thread (the collector runs where it is triggered): set a flag only; the engine loop's
    # watchdog aborts the request.
    request.is_reader_gone = True


class OutputStream:
    """A request's deltas for its reader (see the module's contract); closing it aborts the request. `request`
    has the rest: its state, times, and `on_read_timeout` (called on the loop thread when the request is
    aborted for output left unread too long)."""

    def __init__(self, request: Request, abort: Callable[[str], object]) -> None:
        self.request = request
        self._abort = abort
        self._on_collect = weakref.finalize(self, _reader_collected, request)
        self._on_collect.atexit = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            output = await self.request.next_output()
        except BaseException:  # the reading task was cancelled: the reader is gone
            self.close()
            raise
        if output is None:
            raise StopAsyncIteration
        return output

    def close(self) -> None:
        """The reader is done: an unfinished request is aborted (its unread output dropped). Idempotent."""
        self._on_collect.detach()
        self.request.leave()
        self._abort(self.request.request_id)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> OutputStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()
