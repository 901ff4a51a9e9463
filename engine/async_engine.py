"""The async shell around LLMEngine: input processing off the loop, bounded admission, the step loop, a
watchdog, per-request output streams, drain.

Request state in this shell lives in two maps: `_streams` (every accepted, unfinished request) and `_pending`
(the accepted requests not yet handed to the scheduler). max_pending bounds those together with the requests
still being prepared: reserve() takes their slots (or raises QueueFull, a 429) before any tokenizing, so a
burst is answered at once and never queues unbounded in front of the tokenizer. Everything except run(),
drain() and prepare_*() is synchronous, so the HTTP handlers that call reserve(), submit() and abort() never
wait on the engine. Only the event-loop thread touches engine state; the forward pass runs in one worker thread at a time.
"""

from __future__ import annotations

import enum
import gc
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from anyio.abc import TaskStatus

from engine.batch import StepOutput
from engine.errors import InvalidRequest
from engine.input_processor import Prompt, PreparedRequest
from engine.outputs import FinishReason, RequestOutput
from engine.request_stream import RequestStream
from engine.sampling_params import SamplingParams
from engine.speculative.stats import ProposerCounts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.llm_engine import LLMEngine, StepPlan

logger = logging.getLogger(__name__)

T = TypeVar("T")
ENGINE_FAILED = "the engine failed; the server is shutting down"
WATCHDOG_INTERVAL = 0.25  # seconds between the watchdog's looks at the step and the readers
STOP_MARGIN = 2.0  # seconds a stopping loop may still spend finishing its forward pass before it is abandoned


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STALLED = "stalled"  # a forward pass ran past step_timeout; the process is about to exit
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


class _Abandoned(Exception):
    """The forward pass was left running in its thread: the engine must not be touched again."""


class Reservation:
    """Admission slots held while requests are prepared: submit() spends one, and leaving the `with` block
    gives back the unspent ones (a bad request, a client that left)."""

    def __init__(self, engine: AsyncEngine, num_slots: int) -> None:
        self._engine = engine
        self.num_held = num_slots

    def submit(self, request: PreparedRequest) -> RequestStream:
        if self.num_held <= 0:
            raise RuntimeError("every reserved slot is spent")
        stream = self._engine._enqueue(request)
        self.num_held -= 1
        self._engine._num_reserved -= 1
        return stream

    def release(self) -> None:
        self._engine._num_reserved -= self.num_held
        self.num_held = 0

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


@dataclass(frozen=True, slots=True)
class EngineStats:
    state: str
    waiting: int
    running: int
    pending: int
    free_kv_blocks: int
    total_kv_blocks: int
    prefix_cache_hit_rate: float
    speculation: Mapping[str, ProposerCounts] | None = None  # proposer -> its counters (engine/speculative/)


class AsyncEngine:
    def __init__(
        self,
        load_engine: Callable[[], LLMEngine],
        *,
        max_pending: int,
        step_timeout: float = 120.0,
        client_read_timeout: float = 30.0,
        on_forward_abandoned: Callable[[], None] | None = None,
    ) -> None:
        """on_forward_abandoned: called once if a forward pass is left running (a stall, or a stop that could
        not wait for it); the process should then exit soon, since that thread cannot be stopped."""
        self._load_engine = load_engine
        self._engine: LLMEngine | None = None
        self._state = EngineState.LOADING
        self.max_pending = max_pending
        self.step_timeout = step_timeout
        self.client_read_timeout = client_read_timeout
        self._on_forward_abandoned = on_forward_abandoned
        self._streams: dict[str, RequestStream] = {}
        self._pending: dict[str, RequestStream] = {}  # insertion order is admission order
        self._num_reserved = 0  # admission slots held by requests still being prepared
        self._aborts: set[str] = set()  # admitted requests whose streams ended: freed by the loop between steps
        self._wakeup = anyio.Event()
        self._stop_requested = False
        self._all_finished: anyio.Event | None = None  # set during drain once no request is left
        self._loop_done = anyio.Event()
        self._input_slot = anyio.CapacityLimiter(1)  # tokenization and templates: never more than one thread
        self._forward_slot = anyio.CapacityLimiter(1)
        self._forward_scope: anyio.CancelScope | None = None
        self._forward_started: float | None = None  # monotonic start of the running forward pass
        self.is_forward_abandoned = False

    # -- the public face the HTTP layer uses ---------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def is_loaded(self) -> bool:
        return self._engine is not None

    @property
    def model_name(self) -> str:
        return self._loaded_engine().model_name

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._loaded_engine().tokenizer

    @property
    def max_model_len(self) -> int:
        return self._loaded_engine().max_model_len

    def stats(self) -> EngineStats:
        engine = self._engine
        if engine is None or self._state in (EngineState.DEAD, EngineState.STALLED):
            return EngineStats(self._state.value, 0, 0, len(self._pending) + self._num_reserved, 0, 0, 0.0)
        return EngineStats(
            state=self._state.value,
            waiting=engine.num_waiting,
            running=engine.num_running,
            pending=len(self._pending) + self._num_reserved,
            free_kv_blocks=engine.num_free_blocks,
            total_kv_blocks=engine.num_total_blocks,
            prefix_cache_hit_rate=engine.prefix_cache_hit_rate,
            speculation=engine.speculation_stats.by_proposer,
        )

    async def prepare_prompt(self, request_id: str, prompt: Prompt, params: SamplingParams) -> PreparedRequest:
        """Tokenize and check in a worker thread. InvalidRequest: bad input; EngineUnavailable: 503."""
        processor = self._ready_engine().input_processor
        return await self._off_loop(partial(processor.process_prompt, request_id, prompt, params))

    async def prepare_chat(
        self, request_id: str, messages: Sequence[Mapping[str, Any]], params: SamplingParams, **template_kwargs: Any
    ) -> PreparedRequest:
        processor = self._ready_engine().input_processor
        return await self._off_loop(partial(processor.process_chat, request_id, messages, params, **template_kwargs))

    async def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text to token ids, in a worker thread (what /tokenize does)."""
        processor = self._ready_engine().input_processor
        return await self._off_loop(partial(processor.encode_prompt, text, add_special_tokens=add_special_tokens))

    async def encode_chat(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> list[int]:
        processor = self._ready_engine().input_processor
        return await self._off_loop(partial(processor.encode_chat, messages, **template_kwargs))

    async def decode(self, token_ids: list[int]) -> str:
        processor = self._ready_engine().input_processor
        return await self._off_loop(partial(processor.decode, token_ids))

    def reserve(self, num_requests: int = 1) -> Reservation:
        """Hold admission slots for requests about to be prepared. QueueFull: 429; EngineUnavailable: 503."""
        self._ready_engine()
        num_waiting = len(self._pending) + self._num_reserved
        if num_waiting + num_requests > self.max_pending:
            raise QueueFull(f"{num_waiting} requests are already waiting for admission")
        self._num_reserved += num_requests
        return Reservation(self, num_requests)

    def submit(self, request: PreparedRequest) -> RequestStream:
        """Queue a prepared request: reserve(1) and submit at once. QueueFull: 429; EngineUnavailable: 503."""
        with self.reserve(1) as reservation:
            return reservation.submit(request)

    def _enqueue(self, request: PreparedRequest) -> RequestStream:
        self._ready_engine()
        if request.request_id in self._streams:
            raise InvalidRequest(f"request id {request.request_id!r} is already in use")
        stream = RequestStream(request)
        self._streams[request.request_id] = self._pending[request.request_id] = stream
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> bool:
        """End a request now (its stream gets an "abort" finish). Idempotent; True if it was unfinished.

        A queued request frees its admission slot at once; an admitted one is freed by the loop between steps."""
        return self._end(request_id, FinishReason.ABORT)

    # -- the loop -------------------------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Load and warm the engine (in a worker thread), report started, then step until stopped."""
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
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, tg.cancel_scope)
                await self._step_until_stopped(self._engine)
                tg.cancel_scope.cancel()
        except anyio.get_cancelled_exc_class():
            self._end_everything(FinishReason.ABORT)
            self._state = EngineState.STOPPED
            raise
        except BaseException:
            self._state = EngineState.DEAD
            logger.exception("the engine loop failed; ending every open request")
            self._end_everything(FinishReason.ERROR, ENGINE_FAILED)
            raise
        finally:
            self._loop_done.set()
        if self._state is not EngineState.STALLED:
            self._state = EngineState.STOPPED

    async def _step_until_stopped(self, engine: LLMEngine) -> None:
        while not self._stop_requested:
            self._apply_aborts(engine)
            self._admit_pending(engine)
            plan = engine.schedule_step()
            if plan is None:
                await self._wakeup.wait()
                self._wakeup = anyio.Event()
                continue
            try:
                step_output = await self._forward(engine, plan)
            except _Abandoned:
                return
            except Exception as error:
                outputs = engine.fail_step(plan, error)
            else:
                outputs = engine.finish_step(plan, step_output)
            self._deliver(outputs)
        self._apply_aborts(engine)

    async def _forward(self, engine: LLMEngine, plan: StepPlan) -> StepOutput:
        # Shielded, so that cancelling the loop still lets the step finish and leaves the engine consistent;
        # only the watchdog or a stop that cannot wait cancels this scope itself, and then the thread is
        # abandoned (abandon_on_cancel) and the engine is never used again, so no two passes can overlap.
        self._forward_started = time.monotonic()
        try:
            with anyio.CancelScope(shield=True) as scope:
                self._forward_scope = scope
                return await anyio.to_thread.run_sync(
                    engine.execute, plan, limiter=self._forward_slot, abandon_on_cancel=True
                )
            raise _Abandoned
        finally:
            self._forward_scope = self._forward_started = None

    def _abandon_forward(self) -> None:
        if self._forward_scope is None or self.is_forward_abandoned:
            return
        self.is_forward_abandoned = True
        self._forward_scope.cancel()
        if self._on_forward_abandoned is not None:
            self._on_forward_abandoned()

    def _admit_pending(self, engine: LLMEngine) -> None:
        # Pull only while the scheduler has room, so that max_pending really bounds the waiting requests.
        # A request takes one admission slot, and n of max_num_seqs' places (one per choice) once pulled.
        while self._pending:
            request_id, stream = next(iter(self._pending.items()))
            if engine.num_seats + stream.request.params.n > engine.config.max_num_seqs:
                break
            del self._pending[request_id]
            engine.add_prepared(stream.request)
            stream.admitted_time = time.perf_counter()

    def _apply_aborts(self, engine: LLMEngine) -> None:
        aborts, self._aborts = self._aborts, set()
        for request_id in aborts:
            engine.abort(request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # ended meanwhile (abort or drain): the engine frees it before the next step
            if not stream.push(output):
                self.abort(output.request_id)  # the reader went away
            elif stream.is_finished:
                del self._streams[output.request_id]
                self._note_finished()

    def _end(self, request_id: str, reason: FinishReason, error: str | None = None) -> bool:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        if self._pending.pop(request_id, None) is None:
            self._aborts.add(request_id)
            self._wakeup.set()
        stream.end(reason, error)
        self._note_finished()
        return True

    def _end_everything(self, reason: FinishReason, error: str | None = None) -> None:
        for request_id in list(self._streams):
            self._end(request_id, reason, error)

    # -- the watchdog ---------------------------------------------------------------------------------------
    async def _watch(self, loop_scope: anyio.CancelScope) -> None:
        """A forward pass past step_timeout stalls the engine: every stream ends with an error and the loop
        stops (the process then exits). A reader that leaves output unread past client_read_timeout is aborted."""
        while True:
            await anyio.sleep(WATCHDOG_INTERVAL)
            now = time.monotonic()
            started = self._forward_started
            if started is not None and now - started > self.step_timeout:
                logger.error("a forward pass has run for %.0f s (step_timeout %.0f s): the engine is stalled",
                             now - started, self.step_timeout)  # fmt: skip
                self._state = EngineState.STALLED
                self._end_everything(FinishReason.ERROR, f"the engine stalled (a step ran over {self.step_timeout:g} s)")
                self._stop_requested = True
                self._abandon_forward()
                return
            for stream in [s for s in self._streams.values() if s.unread_since is not None]:
                if now - stream.unread_since > self.client_read_timeout:
                    logger.info("request %s: output unread for %.0f s; aborting it", stream.request_id,
                                now - stream.unread_since)  # fmt: skip
                    self.abort(stream.request_id)
                    if stream.on_read_timeout is not None:
                        stream.on_read_timeout()

    # -- drain ----------------------------------------------------------------------------------------------
    async def drain(self, timeout: float) -> None:
        """Stop admitting, let in-flight requests finish within `timeout`, abort the rest, stop the loop.

        Returns within timeout + STOP_MARGIN even when a forward pass is stuck: that pass is then abandoned."""
        if self._state in (EngineState.READY, EngineState.LOADING):
            self._state = EngineState.DRAINING
        if self._streams:
            self._all_finished = anyio.Event()
            with anyio.move_on_after(timeout):
                await self._all_finished.wait()
        self._end_everything(FinishReason.ABORT)
        self._stop_requested = True
        self._wakeup.set()
        if self._engine is None:
            return
        with anyio.move_on_after(STOP_MARGIN):
            await self._loop_done.wait()
        if not self._loop_done.is_set():
            logger.error("a forward pass did not finish within the drain: abandoning it")
            self._abandon_forward()

    # -- internals ------------------------------------------------------------------------------------------
    def _loaded_engine(self) -> LLMEngine:
        if self._engine is None:
            raise EngineUnavailable(self._state)
        return self._engine

    def _ready_engine(self) -> LLMEngine:
        if self._state is not EngineState.READY or self._engine is None:
            raise EngineUnavailable(self._state)
        return self._engine

    async def _off_loop(self, work: Callable[[], T]) -> T:
        return await anyio.to_thread.run_sync(work, limiter=self._input_slot)

    def _note_finished(self) -> None:
        if not self._streams and self._all_finished is not None:
            self._all_finished.set()
