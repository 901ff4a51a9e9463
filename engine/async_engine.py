"""The async shell around LLMEngine: input processing off the loop, bounded admission, the step loop, a
watchdog, per-request output streams, drain.

A request's way: reserve() takes admission slots (or raises QueueFull, a 429) before any tokenizing, so a burst
is answered at once and never queues unbounded in front of the tokenizer; prepare_*() tokenizes and checks in
a worker thread; Reservation.generate(prepared) (or generate(prepared), which reserves one slot itself) queues
it and returns its OutputStream, whose closing aborts it (engine/request.py has the Request's states and the
reader's contract). The slots held, requests being prepared plus those queued for the scheduler, are bounded by
max_pending plus the scheduler's free places (max_num_seqs not yet taken).

Every request the shell knows of is a Request in one registry, `_requests`, keyed by id, in admission order:
queued, running, or ended from outside (abort, drain) but not yet freed by the LLMEngine, which the loop does
between steps. Everything except run(), drain() and prepare_*() is synchronous, so the HTTP handlers never wait
on the engine. Only the event-loop thread touches engine state; the forward pass runs in one worker thread at a
time.
"""

from __future__ import annotations

import enum
import gc
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskStatus

from engine.abandoned_load import AbandonableLoad
from engine.batch import StepOutput
from engine.errors import InvalidRequest
from engine.input_processor import Prompt, PreparedRequest
from engine.input_slot import InputSlot, chat_size, prompt_size, with_grammar
from engine.outputs import FinishReason, RequestOutput
from engine.reasoning_parser import ReasoningSyntax
from engine.request import OutputStream, Request, RequestState, abort_abandoned
from engine.sampling_params import SamplingParams
from engine.speculative.stats import ProposerCounts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.llm_engine import LLMEngine, StepPlan

logger = logging.getLogger(__name__)

ENGINE_FAILED = "the engine failed; the server is shutting down"
WATCHDOG_INTERVAL = 0.25  # seconds between the watchdog's looks at the step and the readers
# A look this much later than due, while the process used under PAUSED_CPU_SHARE of that time in CPU: it did not
# run (SIGSTOP, a paused container or VM), and that time is neither a step's nor a reader's. (A loop held by work on
# it uses the CPU all along, if only a share of a core on a machine busy with other processes: that is said, and not
# discounted. A busy loop beside a helper's Ray tests on 2 cores got under half a core.)
PAUSED_SECONDS = 2.0
PAUSED_CPU_SHARE = 0.2
# How long requests that fit may go past one whose n choices do not yet (n = 64 waited for every running sequence
# to end, and every request behind it with it); after that the places free up for it and none goes past.
BYPASS_SECONDS = 5.0
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
    def __init__(self, state: EngineState, detail: str | None = None) -> None:
        super().__init__(detail or f"the engine is {state.value}")
        self.state = state


class _Abandoned(Exception):
    """The forward pass was left running in its thread: the engine must not be touched again."""


class Reservation:
    """Admission slots held while requests are prepared (each a Request in PREPARING): generate() queues one,
    and leaving the `with` block gives back the unspent ones (a bad request, a client that left)."""

    def __init__(self, engine: AsyncEngine, num_slots: int) -> None:
        self._engine = engine
        self._preparing = [Request() for _ in range(num_slots)]

    @property
    def num_held(self) -> int:
        return len(self._preparing)

    def generate(self, prepared: PreparedRequest) -> OutputStream:
        """Queue a prepared request on one of the slots: its output stream (see engine/request.py)."""
        if not self._preparing:
            raise RuntimeError("every reserved slot is spent")
        stream = self._engine.queue(self._preparing[-1], prepared)
        self._preparing.pop()
        return stream

    def release(self) -> None:
        self._engine.give_back(len(self._preparing))
        self._preparing = []

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
    num_preemptions: int = 0  # sequences preempted since start (their blocks freed, recomputed later)
    num_prefix_queries: int = 0  # prompt tokens looked up in the prefix cache since start
    num_prefix_hits: int = 0  # of which found


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
        self._requests: dict[str, Request] = {}  # the registry (see the module docstring); insertion = admission order
        self._num_slots_held = 0  # admission slots: requests being prepared or queued (see reserve)
        self._has_ended_in_engine = False  # some registered request ended from outside: the loop frees it
        self._wakeup = anyio.Event()
        self._stop_requested = False
        self._all_finished: anyio.Event | None = None  # set during drain once no request is left
        self._num_ended_at_once = 0  # requests abort_all ended (a second stop signal), for the drain's log
        self._loop_done = anyio.Event()
        self._inputs = InputSlot()
        self._forward_slot = anyio.CapacityLimiter(1)
        self._forward_scope: anyio.CancelScope | None = None
        self._forward_started: float | None = None  # monotonic start of the running forward pass
        self.is_forward_abandoned = False
        self.is_load_abandoned = False  # stopped while loading: the load's thread is left to run (it cannot stop)
        self._load: AbandonableLoad[LLMEngine] | None = None
        self._early_load: Future[LLMEngine] | None = None  # start_loading's

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

    @property
    def reasoning_syntax(self) -> ReasoningSyntax | None:
        """The configured reasoning parser's markers (None: off)."""
        return self._loaded_engine().reasoning_syntax

    def stats(self) -> EngineStats:
        engine = self._engine
        if engine is None or self._state in (EngineState.DEAD, EngineState.STALLED):
            return EngineStats(self._state.value, 0, 0, self._num_slots_held, 0, 0, 0.0)
        return EngineStats(
            state=self._state.value,
            waiting=engine.num_waiting,
            running=engine.num_running,
            pending=self._num_slots_held,
            free_kv_blocks=engine.num_free_blocks,
            total_kv_blocks=engine.num_total_blocks,
            prefix_cache_hit_rate=engine.prefix_cache_hit_rate,
            speculation=engine.speculation_stats.by_proposer,
            num_preemptions=engine.num_preemptions,
            num_prefix_queries=engine.block_manager.num_prefix_queries,
            num_prefix_hits=engine.block_manager.num_prefix_hits,
        )

    async def prepare_prompt(self, request_id: str, prompt: Prompt, params: SamplingParams) -> PreparedRequest:
        """Tokenize and check (see input_slot). InvalidRequest: bad input; EngineUnavailable: 503."""
        processor = self._ready_engine().input_processor
        work = partial(processor.process_prompt, request_id, prompt, params)
        return await self._inputs.run(work, with_grammar(prompt_size(prompt), processor.grammar_compiler, params))

    async def prepare_chat(
        self, request_id: str, messages: Sequence[Mapping[str, Any]], params: SamplingParams, **template_kwargs: Any
    ) -> PreparedRequest:
        processor = self._ready_engine().input_processor
        work = partial(processor.process_chat, request_id, messages, params, **template_kwargs)
        size = with_grammar(chat_size(messages, template_kwargs), processor.grammar_compiler, params)
        return await self._inputs.run(work, size)

    async def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text to token ids (what /tokenize does)."""
        processor = self._ready_engine().input_processor
        work = partial(processor.encode_prompt, text, add_special_tokens=add_special_tokens)
        return await self._inputs.run(work, prompt_size(text))

    async def encode_chat(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> list[int]:
        processor = self._ready_engine().input_processor
        work = partial(processor.encode_chat, messages, **template_kwargs)
        return await self._inputs.run(work, chat_size(messages, template_kwargs))

    async def decode(self, token_ids: list[int]) -> str:
        processor = self._ready_engine().input_processor
        return await self._inputs.run(partial(processor.decode, token_ids), prompt_size(token_ids))

    def reserve(self, num_requests: int = 1, num_choices: int = 1) -> Reservation:
        """Hold admission slots for requests about to be prepared (num_choices each: their n). QueueFull: 429;
        EngineUnavailable: 503.

        The slots are max_pending plus the requests the scheduler's free places take (n places each), which the
        loop fills between steps: a burst that arrives during a step waits for those places, and only what would
        wait beyond them counts against max_pending (a burst of 100 with 64 free places and max_pending 16 got 68
        429s)."""
        engine = self._ready_engine()
        num_free_places = max(0, engine.config.max_num_seqs - engine.num_seats) // max(1, num_choices)
        if self._num_slots_held + num_requests > self.max_pending + num_free_places:
            raise QueueFull(f"{self._num_slots_held} requests are already waiting for the scheduler's free places "
                            f"({num_free_places} for this request now) and max_pending ({self.max_pending}) more")  # fmt: skip
        self._num_slots_held += num_requests
        return Reservation(self, num_requests)

    def generate(self, prepared: PreparedRequest) -> OutputStream:
        """Queue a prepared request (reserve(1) and Reservation.generate at once): its output stream, whose
        closing aborts it. QueueFull: 429; EngineUnavailable: 503; InvalidRequest: its id is in use."""
        with self.reserve(1) as reservation:
            return reservation.generate(prepared)

    def queue(self, request: Request, prepared: PreparedRequest) -> OutputStream:
        """A Reservation's PREPARING request becomes QUEUED on its slot (Reservation.generate calls this)."""
        self._ready_engine()
        if prepared.request_id in self._requests:
            raise InvalidRequest(f"request id {prepared.request_id!r} is already in use")
        request.bind(prepared)
        self._requests[prepared.request_id] = request
        self._wakeup.set()
        return OutputStream(request, self.abort)

    def give_back(self, num_slots: int) -> None:
        """Admission slots of requests that were never queued (a Reservation's unspent ones)."""
        self._num_slots_held -= num_slots

    def abort(self, request_id: str) -> bool:
        """End a request now (its stream gets an "abort" finish). Idempotent; True if it was unfinished.

        A queued request frees its admission slot at once; an admitted one is freed by the loop between steps.
        Readers need not call this: closing the OutputStream does."""
        return self._end(request_id, FinishReason.ABORT)

    def abort_all(self) -> None:
        """End every request now with an "abort" finish (a second stop signal: a drain that stops at once)."""
        self._num_ended_at_once += self._num_unfinished()
        self._end_everything(FinishReason.ABORT)

    # -- the loop -------------------------------------------------------------------------------------------
    def start_loading(self) -> None:
        """Begin the load now, in a thread of its own, not when run() starts: a server calls this once torch is
        imported, so that the weights pack (outside the GIL, on the other cores) while the web stack imports and
        Hypercorn binds. run() waits for that load; a stop before it ends abandons it as it would run()'s own."""
        if self._load is None:
            self._load = AbandonableLoad(self._load_engine)
            self._early_load = self._load.start_thread()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Load and warm the engine (in a worker thread, or start_loading's), report started, then step until
        stopped."""
        try:
            # abandon_on_cancel: a stop during a load (SIGTERM while a large file packs) is not kept waiting for it
            load = self._load = self._load or AbandonableLoad(self._load_engine)
            wait_for_load = self._early_load.result if self._early_load is not None else load
            self._engine = await anyio.to_thread.run_sync(wait_for_load, abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            self._state = EngineState.STOPPED
            self.is_load_abandoned = True
            load.abandon()
            logger.info("stopped before the model had loaded")
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
        now = time.perf_counter()
        for request in [r for r in self._requests.values() if r.state is RequestState.QUEUED]:
            if engine.num_seats + request.num_choices > engine.config.max_num_seqs:
                if now - request.arrival_time >= BYPASS_SECONDS:
                    break  # it has waited long enough: the places now free up for it, and none goes past it
                continue  # (its n choices wait for n places) the requests behind it that fit go first
            engine.add_prepared(request.prepared)
            request.start()
            self._num_slots_held -= 1

    def _apply_aborts(self, engine: LLMEngine) -> None:
        if not self._has_ended_in_engine:
            return
        self._has_ended_in_engine = False
        for request in [r for r in self._requests.values() if r.is_finished and r.is_in_engine]:
            engine.abort(request.request_id)
            self._forget(request)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            request = self._requests.get(output.request_id)
            if request is None or request.is_finished:
                continue  # ended meanwhile (abort or drain): the engine frees it before the next step
            is_read = request.push(output)
            if request.is_finished:  # the engine freed it with its last choice
                self._forget(request)
                self._note_finished()
            elif not is_read:
                self.abort(output.request_id)  # the reader went away

    def _end(self, request_id: str, reason: FinishReason, error: str | None = None) -> bool:
        request = self._requests.get(request_id)
        if request is None or request.is_finished:
            return False
        if request.state is RequestState.QUEUED:
            self._num_slots_held -= 1
            self._forget(request)
        else:  # the engine holds it: freed by the loop between steps
            self._has_ended_in_engine = True
            self._wakeup.set()
        request.end(reason, error)
        self._note_finished()
        return True

    def _forget(self, request: Request) -> None:
        request.is_in_engine = False
        del self._requests[request.request_id]

    def _end_everything(self, reason: FinishReason, error: str | None = None) -> None:
        for request_id in list(self._requests):
            self._end(request_id, reason, error)

    # -- the watchdog ---------------------------------------------------------------------------------------
    async def _watch(self, loop_scope: anyio.CancelScope) -> None:
        """A forward pass past step_timeout stalls the engine: every stream ends with an error and the loop
        stops (the process then exits). A reader that leaves output unread past client_read_timeout is aborted."""
        last_look, last_cpu = time.monotonic(), time.process_time()
        while True:
            await anyio.sleep(WATCHDOG_INTERVAL)
            now, cpu = time.monotonic(), time.process_time()
            late, cpu_used = now - last_look - WATCHDOG_INTERVAL, cpu - last_cpu
            last_look, last_cpu = now, cpu
            if late > PAUSED_SECONDS and cpu_used < (late + WATCHDOG_INTERVAL) * PAUSED_CPU_SHARE:
                self._discount_pause(late)
            elif late > PAUSED_SECONDS:
                logger.warning("the event loop was held for %.1f s by work on it (every stream waited)", late)
            started = self._forward_started
            if started is not None and now - started > self.step_timeout:
                logger.error("a forward pass has run for %.3g s (step_timeout %g s): the engine is stalled",
                             now - started, self.step_timeout)  # fmt: skip
                self._state = EngineState.STALLED
                self._end_everything(FinishReason.ERROR, f"the engine stalled (a step ran over {self.step_timeout:g} s)")
                self._stop_requested = True
                self._abandon_forward()
                return
            abort_abandoned(self._requests.values(), self.client_read_timeout, self.abort)

    def _discount_pause(self, seconds: float) -> None:
        """Time the process did not run counts against neither the running forward pass nor a reader."""
        logger.warning("the process did not run for %.1f s (stopped or paused): not counted against step_timeout "
                       "or client_read_timeout", seconds)  # fmt: skip
        if self._forward_started is not None:
            self._forward_started += seconds
        for request in self._requests.values():
            if request.unread_since is not None:
                request.unread_since += seconds

    # -- drain ----------------------------------------------------------------------------------------------
    async def drain(self, timeout: float) -> None:
        """Stop admitting, let in-flight requests finish within `timeout`, abort the rest, stop the loop.

        Returns within timeout + STOP_MARGIN even when a forward pass is stuck: that pass is then abandoned."""
        if self._state in (EngineState.READY, EngineState.LOADING):
            self._state = EngineState.DRAINING
        num_in_flight = self._num_unfinished()  # not those ended already, not yet freed (a second drain's)
        if self._has_unfinished():
            if self._all_finished is None:  # one event for every drain: a second call must not orphan the first
                self._all_finished = anyio.Event()
            with anyio.move_on_after(timeout):
                await self._all_finished.wait()
        log_drained(num_in_flight, self._num_unfinished(), timeout, self._num_ended_at_once)
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

    def _num_unfinished(self) -> int:
        return sum(not request.is_finished for request in self._requests.values())

    def _has_unfinished(self) -> bool:
        return any(not request.is_finished for request in self._requests.values())

    def _note_finished(self) -> None:
        if self._all_finished is not None and not self._has_unfinished():
            self._all_finished.set()


def log_drained(num_in_flight: int, num_left: int, timeout: float, num_ended_at_once: int = 0,
                num_failed: int = 0) -> None:  # fmt: skip
    """What a drain did with the requests in flight when it began (nothing to say when there were none): those
    that finished (num_failed of them with an error: a replica that died meanwhile), those a second stop signal
    ended, those the deadline ended."""
    if not num_in_flight:
        return
    num_ended_at_once = min(num_ended_at_once, num_in_flight - num_left)
    if num_ended_at_once:
        num_aborted, when = num_ended_at_once, "a second stop signal"
    else:
        num_aborted, when = num_left, f"drain_timeout ({timeout:g} s)"
    num_finished = num_in_flight - num_left - num_ended_at_once
    failed = f" ({min(num_failed, num_finished)} of them with an error)" if num_failed else ""
    logger.info("drain: %d of %d requests in flight finished%s, %d ended with finish_reason 'abort' at %s",
                num_finished, num_in_flight, failed, num_aborted, when)  # fmt: skip
