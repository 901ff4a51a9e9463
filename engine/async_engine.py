"""The async shell around LLMEngine: bounded admission, per-request output streams, the step loop, drain.

Only the event-loop thread touches engine state; the forward pass (LLMEngine.execute) runs in one worker
thread at a time. Everything here except run() and drain() is synchronous, so the HTTP handlers that call
submit() and abort() never wait on the engine.
"""

from __future__ import annotations

import enum
import gc
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    DEAD = "dead"


class AdmissionError(Exception):
    """The request was not accepted; nothing was queued."""


class QueueFull(AdmissionError):
    pass


class EngineUnavailable(AdmissionError):
    def __init__(self, state: EngineState) -> None:
        super().__init__(f"the engine is {state.value}")
        self.state = state


@dataclass(frozen=True, slots=True)
class EngineStats:
    state: str
    waiting: int
    running: int
    pending: int
    free_kv_blocks: int
    total_kv_blocks: int
    prefix_cache_hit_rate: float


class RequestStream:
    """One request's deltas, in order; the last one has finished=True. Iterate it with `async for`."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival_time = time.perf_counter()
        self.admitted_time: float | None = None  # when the loop handed it to the scheduler
        self.cancelled = False  # aborted while still in the admission queue: the loop drops it
        # Unbounded on purpose: the loop must never block on a slow reader, and a request yields at most
        # max_tokens + 1 deltas.
        self._send: MemoryObjectSendStream[RequestOutput]
        self._receive: MemoryObjectReceiveStream[RequestOutput]
        self._send, self._receive = anyio.create_memory_object_stream[RequestOutput](math.inf)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None

    def close(self) -> None:
        """The reader is gone: later deliveries fail and the request is aborted."""
        self._receive.close()

    def _push(self, output: RequestOutput) -> bool:
        try:
            self._send.send_nowait(output)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        if output.finished:
            self._send.close()
        return True

    def _terminal(self, finish_reason: str, error: str | None = None) -> RequestOutput:
        """The final delta of a request that the engine itself cannot end (queued, or the loop is gone)."""
        output = RequestOutput(self.request_id, [], "", True, finish_reason, error=error)
        output.num_prompt_tokens = len(self.prompt_token_ids)
        return output


class AsyncEngine:
    def __init__(self, load_engine: Callable[[], LLMEngine], *, max_pending: int) -> None:
        self._load_engine = load_engine
        self._engine: LLMEngine | None = None
        self._state = EngineState.LOADING
        self._pending_send, self._pending_receive = anyio.create_memory_object_stream[RequestStream](max_pending)
        self._requests: dict[str, RequestStream] = {}  # every accepted, unfinished request
        self._wakeup = anyio.Event()
        self._stop_requested = False
        self._all_finished: anyio.Event | None = None  # set during drain once no request is left
        self._num_cancelled_pending = 0  # aborted but still in the admission stream until the loop drops them

    # -- state seen by the HTTP layer --------------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise EngineUnavailable(self._state)
        return self._engine

    @property
    def num_pending(self) -> int:
        return self._pending_receive.statistics().current_buffer_used - self._num_cancelled_pending

    def stats(self) -> EngineStats:
        engine = self._engine
        if engine is None or self._state is EngineState.DEAD:
            return EngineStats(self._state.value, 0, 0, self.num_pending, 0, 0, 0.0)
        return EngineStats(
            state=self._state.value,
            waiting=engine.num_waiting,
            running=engine.num_running,
            pending=self.num_pending,
            free_kv_blocks=engine.num_free_blocks,
            total_kv_blocks=engine.num_total_blocks,
            prefix_cache_hit_rate=engine.prefix_cache_hit_rate,
        )

    def _ready_engine(self) -> LLMEngine:
        if self._state is not EngineState.READY or self._engine is None:
            raise EngineUnavailable(self._state)
        return self._engine

    # -- called by request handlers (synchronous) ----------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self._ready_engine().encode_prompt(prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self._ready_engine().encode_chat(messages)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a tokenized request. ValueError: too long; QueueFull: 429; EngineUnavailable: 503."""
        engine = self._ready_engine()
        engine.check_request(len(prompt_token_ids), params)
        stream = RequestStream(request_id, prompt_token_ids, params)
        try:
            self._pending_send.send_nowait(stream)
        except anyio.WouldBlock:
            raise QueueFull(f"{self.num_pending} requests are already waiting for admission") from None
        self._requests[request_id] = stream
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> bool:
        """Idempotent. True when the request was still unfinished (it then gets a final "abort" delta)."""
        stream = self._requests.pop(request_id, None)
        if stream is None:
            return False
        final = None
        if stream.admitted_time is None:
            self._cancel_pending(stream)
        elif self._engine is not None and self._state is not EngineState.DEAD:
            final = self._engine.abort(request_id)
        stream._push(final if final is not None else stream._terminal("abort"))
        self._note_finished()
        return True

    def _cancel_pending(self, stream: RequestStream) -> None:
        if not stream.cancelled:
            stream.cancelled = True
            self._num_cancelled_pending += 1

    # -- the loop -------------------------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Load and warm the engine (in a worker thread), report started, then step until drained."""
        try:
            self._engine = await anyio.to_thread.run_sync(self._load_engine)
        except anyio.get_cancelled_exc_class():
            self._state = EngineState.STOPPED
            raise
        except BaseException:
            self._state = EngineState.DEAD
            raise
        # The model, tokenizer and libraries loaded by now live as long as the process: moving them out of
        # the collector's reach cuts full collections from hundreds of ms (event-loop stalls) to a few.
        # Collect first, so that no garbage of the load (or of an earlier engine) is frozen with them.
        gc.collect()
        gc.freeze()
        if self._state is EngineState.LOADING:
            self._state = EngineState.READY
        task_status.started()
        try:
            await self._step_until_stopped()
        except anyio.get_cancelled_exc_class():
            self._abort_everything()
            self._state = EngineState.STOPPED
            raise
        except BaseException as exc:
            self._state = EngineState.DEAD
            logger.exception("the engine loop failed; ending every open request")
            message = f"the engine failed: {exc!r}"
            self._end_everything(lambda stream: stream._terminal("error", message))
            raise
        self._state = EngineState.STOPPED

    async def _step_until_stopped(self) -> None:
        engine = self.engine
        forward_pass_slot = anyio.CapacityLimiter(1)
        while not self._stop_requested:
            self._admit_pending(engine)
            plan = engine.schedule_step()
            if plan is None:
                await self._wakeup.wait()
                self._wakeup = anyio.Event()
                continue
            try:
                # Never abandon_on_cancel: the limiter would be released while the thread still runs. The
                # shield lets a cancelled loop still finish the step, so the engine is left consistent.
                with anyio.CancelScope(shield=True):
                    sampled = await anyio.to_thread.run_sync(engine.execute, plan, limiter=forward_pass_slot)
            except Exception as exc:
                logger.exception("a forward pass failed; failing its requests")
                outputs = engine.fail_step(plan, exc)
            else:
                outputs = engine.finish_step(plan, sampled)
            self._deliver(outputs)

    def _admit_pending(self, engine: LLMEngine) -> None:
        # Pull only while the scheduler has room, so that max_pending really bounds the waiting requests.
        while engine.num_waiting + engine.num_running < engine.config.max_num_seqs:
            try:
                stream = self._pending_receive.receive_nowait()
            except anyio.WouldBlock:
                return
            if stream.cancelled:
                self._num_cancelled_pending -= 1
                continue
            try:
                engine.add_request(stream.request_id, stream.prompt_token_ids, stream.params)
            except ValueError as exc:
                self._requests.pop(stream.request_id, None)
                stream._push(stream._terminal("error", str(exc)))
                self._note_finished()
                continue
            stream.admitted_time = time.perf_counter()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._requests.get(output.request_id)
            if stream is None:
                continue
            if not stream._push(output):
                self.abort(output.request_id)  # the reader went away: BrokenResourceError means abort
            elif output.finished:
                del self._requests[output.request_id]
                self._note_finished()

    def _end_everything(self, terminal: Callable[[RequestStream], RequestOutput]) -> None:
        requests, self._requests = self._requests, {}
        for stream in requests.values():
            if stream.admitted_time is None:
                self._cancel_pending(stream)
            stream._push(terminal(stream))
        self._note_finished()

    # -- drain ----------------------------------------------------------------------------------------------
    async def drain(self, timeout: float) -> None:
        """Stop admitting, let in-flight requests finish within `timeout`, abort the rest, stop the loop."""
        if self._state in (EngineState.READY, EngineState.LOADING):
            self._state = EngineState.DRAINING
        if self._requests:
            self._all_finished = anyio.Event()
            with anyio.move_on_after(timeout):
                await self._all_finished.wait()
        self._abort_everything()
        self._stop_requested = True
        self._wakeup.set()

    def _abort_everything(self) -> None:
        for request_id in [rid for rid, s in self._requests.items() if s.admitted_time is None]:
            self.abort(request_id)
        if self._engine is not None and self._state is not EngineState.DEAD:
            self._deliver(self._engine.abort_all())
        self._end_everything(lambda stream: stream._terminal("abort"))

    def _note_finished(self) -> None:
        if not self._requests and self._all_finished is not None:
            self._all_finished.set()
