"""The front's engine when the engines are replicas on Ray Serve: the same face the routes use on an AsyncEngine
(reserve / generate / abort / stats / prepare_* / run / drain), so that the HTTP layer does not change.

The front tokenizes and checks here (the replicas' tokenizer travels to it), routes each prepared request to
one replica (web/cluster/router.py) and submits it there (those of one lap to one replica in one call:
web/cluster/submit_batches.py); one stream a replica (web/cluster/replica.py's outputs()) brings back the deltas
of all of this front's requests there, every delta that was ready in one item, and each goes into its local
Request (engine/request.py), whose OutputStream the SSE writer reads exactly as it reads a local engine's. Every
request's stream ends once: the replica's finish, an abort (client gone, drain: the replica is told, and frees
its KV before its next step), or an error event when the replica fails (its process died, and with it the
stream). A failed replica leaves the routing at once and rejoins when it answers again (Ray Serve restarts it; a
new process forgets its prefix memory).
Only the event-loop thread touches this state; Ray calls are awaited, never blocking the loop, except the
start and the shutdown of Ray, which run in a worker thread.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

from engine.async_engine import EngineState, EngineUnavailable, QueueFull, Reservation, log_drained
from engine.config import SluiceConfig
from engine.reasoning_parser import ReasoningSyntax, reasoning_syntax
from engine.errors import InvalidRequest
from engine.input_processor import InputProcessor, PreparedRequest, Prompt
from engine.input_slot import InputSlot, chat_size, prompt_size, with_grammar
from engine.outputs import NOT_RUN, FinishReason, RequestOutput
from engine.request import OutputStream, Request, abort_abandoned
from engine.sampling_params import SamplingParams
from engine.speculative.stats import ProposerCounts, summed_counts
from web.cluster.router import Router, prompt_block_hashes
from web.cluster.stats import ClusterStats, ReplicaStats
from web.cluster.submit_batches import LapBatches, Refusal

logger = logging.getLogger("sluice.cluster")

POLL_INTERVAL = 0.2  # seconds between two reports of each replica's load
POLL_TIMEOUT = 2.0  # a replica that does not answer within this leaves the routing until it does
START_TIMEOUT = 900.0  # Ray's start plus every replica's model load and warm-up
SHUTDOWN_TIMEOUT = 60.0
REPLICA_FAILED = "the replica serving this request failed"
NO_REPLICA_READY = "no replica is ready (they are restarting)"
COUNTERS = ("num_preemptions", "num_prefix_queries", "num_prefix_hits")  # ReplicaStats' that only go up
REPLICA_FULL = "the replica chosen for this request was full (other fronts share it): retry"


@dataclass(eq=False)
class ReplicaSlot:
    """One replica as the front sees it."""

    index: int
    handle: Any  # a Ray Serve DeploymentHandle
    stats: ReplicaStats | None = None
    is_ready: bool = False
    num_in_flight: int = 0  # requests this front has sent there and not yet ended
    num_restarts: int = 0
    earlier: dict[str, int] = field(default_factory=dict)  # COUNTERS of the slot's replaced replicas: never down
    earlier_speculation: dict[str, ProposerCounts] = field(default_factory=dict)  # theirs, likewise
    failed_at: float | None = None  # monotonic time of the last failure seen in one of its streams
    is_answering: bool = False  # its last report came, and no stream failed since
    listener: anyio.CancelScope | None = None  # the reader of its outputs() stream, while one runs

    def count(self, counter: str) -> int:
        """One of COUNTERS over every replica the slot has had."""
        return self.earlier.get(counter, 0) + (getattr(self.stats, counter) if self.stats is not None else 0)

    def speculation(self) -> dict[str, ProposerCounts]:
        """The speculation counters by proposer over every replica the slot has had."""
        return summed_counts(self.earlier_speculation, self.stats.speculation if self.stats is not None else {})

    @property
    def load(self) -> int:
        reported = self.stats.load if self.stats is not None else 0
        return max(reported, self.num_in_flight)


@dataclass(eq=False)
class _InFlight:
    request: Request
    slot: ReplicaSlot
    is_submitted: bool = False  # the replica has it: ending it early means telling the replica
    num_delivered: int = 0  # its deltas passed on to the client
    submit_scope: anyio.CancelScope | None = None  # while its submit travels (its batch's)


class ClusterEngine:
    def __init__(self, config: SluiceConfig, launch: Callable[[SluiceConfig], Any] | None = None) -> None:
        """launch: starts Ray and the replicas and returns a handle with `.handles` and `.shutdown()`
        (web/cluster/launch.py's, by default)."""
        self.config = config
        self.num_replicas = config.cluster.replicas
        self.max_pending = config.server.max_pending
        self.client_read_timeout = config.server.client_read_timeout
        self._launch_fn = launch
        self._launched: Any = None
        self._state = EngineState.LOADING
        self._slots: list[ReplicaSlot] = []
        self._router: Router | None = None
        self._processor: InputProcessor | None = None
        self._model_name = ""
        self._max_num_seqs = 0
        self._block_size = 16
        self._requests: dict[str, _InFlight] = {}
        self._num_reserved = 0  # admission slots held by requests still being prepared (Reservation)
        self._tg: TaskGroup | None = None
        self._stop = anyio.Event()
        self._all_finished: anyio.Event | None = None
        self._num_ended_at_once = 0  # requests abort_all ended (a second stop signal), for the drain's log
        self._num_failed_draining = 0  # requests ended with an error while draining (a replica died), for the same
        self._shutdown_done: anyio.Event | None = None
        self._launch_done: anyio.Event | None = None  # set when Ray's start (in its thread) has returned or failed
        self._launch_scope: anyio.CancelScope | None = None  # the start's shield: _shutdown bounds the wait for it
        self._inputs = InputSlot()
        self._submits: LapBatches[ReplicaSlot, tuple[PreparedRequest, _InFlight]] = LapBatches(self._submit)
        self._front_id = uuid.uuid4().hex  # names this front's requests and output stream to the replicas
        self.is_forward_abandoned = False  # no forward pass runs in this process

    # -- the face the routes use ---------------------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        if self._state is EngineState.READY and not any(s.is_ready for s in self._slots):
            return EngineState.LOADING  # every replica is restarting: Ray Serve is loading their replacements
        return self._state

    @property
    def is_loaded(self) -> bool:
        return self._processor is not None

    @property
    def model_name(self) -> str:
        self._loaded()
        return self._model_name

    @property
    def tokenizer(self) -> Any:
        return self._loaded().tokenizer

    @property
    def max_model_len(self) -> int:
        return self._loaded().max_model_len

    @property
    def reasoning_syntax(self) -> ReasoningSyntax | None:
        """The replicas' reasoning parser (their detokenizers hold its markers back, as one process's does)."""
        return reasoning_syntax(self.config.engine.reasoning_parser)

    async def prepare_prompt(self, request_id: str, prompt: Prompt, params: SamplingParams) -> PreparedRequest:
        processor = self._ready()
        work = partial(processor.process_prompt, request_id, prompt, params)
        return await self._inputs.run(work, with_grammar(prompt_size(prompt), processor.grammar_compiler, params))

    async def prepare_chat(
        self, request_id: str, messages: Sequence[Mapping[str, Any]], params: SamplingParams, **template_kwargs: Any
    ) -> PreparedRequest:
        processor = self._ready()
        work = partial(processor.process_chat, request_id, messages, params, **template_kwargs)
        size = with_grammar(chat_size(messages, template_kwargs), processor.grammar_compiler, params)
        return await self._inputs.run(work, size)

    async def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        work = partial(self._ready().encode_prompt, text, add_special_tokens=add_special_tokens)
        return await self._inputs.run(work, prompt_size(text))

    async def encode_chat(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> list[int]:
        work = partial(self._ready().encode_chat, messages, **template_kwargs)
        return await self._inputs.run(work, chat_size(messages, template_kwargs))

    async def decode(self, token_ids: list[int]) -> str:
        return await self._inputs.run(partial(self._ready().decode, token_ids), prompt_size(token_ids))

    def reserve(self, num_requests: int = 1, num_choices: int = 1) -> Reservation:
        """Slots for requests about to be prepared: a replica takes max_num_seqs running plus max_pending
        queued, as one process does; QueueFull (429) when the ready replicas together have no room. Counted in
        requests (num_choices is the one process's refinement: its free places are known to it alone)."""
        self._ready()
        capacity = self._places_per_replica * sum(s.is_ready for s in self._slots)
        num_held = len(self._requests) + self._num_reserved
        if num_held + num_requests > capacity:
            raise QueueFull(f"{num_held} requests are in flight or being prepared, for {capacity} places")
        self._num_reserved += num_requests
        return Reservation(self, num_requests)  # type: ignore[arg-type]  # it needs queue and give_back

    def generate(self, prepared: PreparedRequest) -> OutputStream:
        with self.reserve(1) as reservation:
            return reservation.generate(prepared)

    def give_back(self, num_slots: int) -> None:
        """Admission slots of requests that were never queued (a Reservation's unspent ones)."""
        self._num_reserved -= num_slots

    def abort(self, request_id: str) -> bool:
        """End a request now ("abort"); its replica is told. Idempotent."""
        return self._end(request_id, FinishReason.ABORT)

    def abort_all(self) -> None:
        """End every request now with an "abort" finish; each replica is told (a second stop signal)."""
        self._num_ended_at_once += len(self._requests)
        self._end_everything(FinishReason.ABORT)

    def stats(self) -> ClusterStats:
        reported = [s.stats for s in self._slots if s.is_ready and s.stats is not None]
        queries = sum(r.num_prefix_queries for r in reported)
        router = self._router
        return ClusterStats(
            state=self.state.value,
            waiting=sum(r.waiting for r in reported),
            running=sum(r.running for r in reported),
            pending=sum(r.pending for r in reported) + self._num_reserved,
            free_kv_blocks=sum(r.free_kv_blocks for r in reported),
            total_kv_blocks=sum(r.total_kv_blocks for r in reported),
            prefix_cache_hit_rate=sum(r.num_prefix_hits for r in reported) / queries if queries else 0.0,
            # counters: the replaced and the unready replicas' too
            num_preemptions=sum(s.count("num_preemptions") for s in self._slots),
            num_prefix_queries=sum(s.count("num_prefix_queries") for s in self._slots),
            num_prefix_hits=sum(s.count("num_prefix_hits") for s in self._slots),
            speculation=summed_counts(*(s.speculation() for s in self._slots)),
            num_ready=sum(s.is_ready for s in self._slots),
            routing=self.config.cluster.routing,
            decisions=dict(router.decisions) if router is not None else {},
            replicas=[_replica_body(s) for s in self._slots],
        )

    # -- start, run, drain ---------------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start Ray and the replicas (in a thread), wait for every replica, report started, then poll their
        load until drained."""
        is_started = False
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                await self._start()
                if not self._stop.is_set():
                    is_started = True
                    self._state = EngineState.READY
                    logger.info("%d replicas ready, routing %s", self.num_replicas, self.config.cluster.routing)
                    task_status.started()
                    await self._poll_until_stopped()
                tg.cancel_scope.cancel()  # the replicas' listeners: before Ray's shutdown ends their streams
            self._tg = None
            if not is_started:  # stopped while starting: a return is an error to tg.start
                logger.info("stopped before the replicas were ready")
                await anyio.sleep_forever()  # the host's cancel ends it, as it ends one process's load
        finally:
            self._tg = None
            if self._state is not EngineState.DRAINING:
                self._end_everything(FinishReason.ABORT)
            with anyio.CancelScope(shield=True):
                await self._shutdown()
            # A start that failed (a replica refused the model) is a dead engine: the host exits 1 with its reason.
            is_clean = self._state in (EngineState.READY, EngineState.DRAINING) or self._stop.is_set()
            self._state = EngineState.STOPPED if is_clean else EngineState.DEAD

    async def drain(self, timeout: float) -> None:
        """Stop admitting (503), let the streams in flight on every replica finish within `timeout`, abort the
        rest (each replica frees them), then stop the replicas and Ray."""
        if self._state in (EngineState.READY, EngineState.LOADING):
            self._state = EngineState.DRAINING
        num_in_flight = len(self._requests)
        if self._requests:
            if self._all_finished is None:  # one event for every drain: a second call must not orphan the first
                self._all_finished = anyio.Event()
            with anyio.move_on_after(timeout):
                await self._all_finished.wait()
        log_drained(num_in_flight, len(self._requests), timeout, self._num_ended_at_once, self._num_failed_draining)
        self._end_everything(FinishReason.ABORT)
        self._stop.set()
        await self._shutdown()

    async def _start(self) -> None:
        launch = self._launch_fn
        if launch is None:
            try:
                from web.cluster.launch import launch_replicas  # Ray: imported only now
            except ImportError as error:  # the cluster extra is not installed (or not whole)
                raise ValueError(f"replicas = {self.num_replicas} needs Ray Serve: pip install -e '.[cluster]' "
                                 f"({error})") from None

            # A SIGTERM in the seconds Serve takes to start would meet ray.init's handler (a stack dump, then abort)
            launch = partial(launch_replicas, on_ray_started=partial(anyio.from_thread.run_sync, _take_back_signals))
        if self._stop.is_set():
            return
        # A stop while Ray starts (ray.init cannot be interrupted) waits for the start, so that _shutdown stops what
        # it started: an abandoned start went on in its thread while the process exited, which then lingered a
        # minute and exited 1 ("Failed to connect to GCS"). _shutdown bounds the wait.
        self._launch_done = anyio.Event()
        with anyio.CancelScope(shield=True) as self._launch_scope:
            try:
                self._launched = await anyio.to_thread.run_sync(launch, self.config, abandon_on_cancel=True)
            finally:
                self._launch_done.set()
        if self._launched is None:  # the wait bounded by _shutdown ran out
            return
        _take_back_signals()
        self._slots = [ReplicaSlot(i, h) for i, h in enumerate(self._launched.handles)]
        with anyio.fail_after(START_TIMEOUT):
            while not self._stop.is_set() and not all(s.is_ready for s in self._slots):
                self._launched.raise_if_failed()
                await self._poll_once()
                if not all(s.is_ready for s in self._slots):
                    await anyio.sleep(POLL_INTERVAL)
        if self._stop.is_set():
            return
        facts = await self._slots[0].handle.facts.remote()
        self._model_name = self.config.server.served_model_name or facts.model_name
        self._max_num_seqs = facts.max_num_seqs
        self._block_size = facts.block_size
        self._router = Router(
            self.config.cluster.routing, self.num_replicas, memory_blocks=facts.num_kv_blocks * self.num_replicas
        )
        self._processor = InputProcessor(
            facts.tokenizer, facts.vocab_size, facts.max_model_len, facts.eos_token_ids, facts.max_num_seqs
        )
        self._processor.reasoning_syntax = self.reasoning_syntax  # where each output starts: read here, once

    async def _shutdown(self) -> None:
        """Stop the replicas and Ray, once. A later call (a second drain, run's end) waits for the first: a
        shutdown left running in a thread while the process exits races Ray's own exit, and a Ray call after
        ray.shutdown() starts a new local cluster."""
        if self._shutdown_done is not None:
            with anyio.move_on_after(SHUTDOWN_TIMEOUT):
                await self._shutdown_done.wait()
            return
        self._shutdown_done = anyio.Event()
        try:
            if self._launch_scope is not None and self._launch_done is not None and not self._launch_done.is_set():
                self._launch_scope.deadline = anyio.current_time() + SHUTDOWN_TIMEOUT
                await self._launch_done.wait()
            launched, self._launched = self._launched, None
            if launched is not None:
                with anyio.move_on_after(SHUTDOWN_TIMEOUT):
                    await anyio.to_thread.run_sync(launched.shutdown, abandon_on_cancel=True)
        finally:
            self._shutdown_done.set()

    async def _poll_until_stopped(self) -> None:
        while not self._stop.is_set():
            with anyio.move_on_after(POLL_INTERVAL):
                await self._stop.wait()
            await self._poll_once()
            self._abort_unread()

    async def _poll_once(self) -> None:
        async with anyio.create_task_group() as tg:
            for slot in self._slots:
                tg.start_soon(self._poll, slot)

    async def _poll(self, slot: ReplicaSlot) -> None:
        asked_at = time.monotonic()
        stats: ReplicaStats | None = None
        with anyio.move_on_after(POLL_TIMEOUT):
            try:
                stats = await slot.handle.stats.remote()
            except Exception as error:  # the replica is dead or restarting
                logger.debug("replica %d: no report (%s)", slot.index, error)
        if stats is None:
            if slot.is_ready:
                logger.warning("replica %d does not answer: it leaves the routing", slot.index)
            slot.is_ready = slot.is_answering = False
            return
        if slot.failed_at is not None and slot.failed_at > asked_at:
            return  # a stream failed while this report travelled: wait for a report from after the failure
        if slot.stats is not None and stats.pid != slot.stats.pid:
            slot.num_restarts += 1
            slot.earlier = {counter: slot.count(counter) for counter in COUNTERS}
            slot.earlier_speculation = slot.speculation()
            if self._router is not None:
                self._router.memory.forget(slot.index)
            logger.info("replica %d restarted (pid %d -> %d)", slot.index, slot.stats.pid, stats.pid)
        if not slot.is_ready and stats.state == EngineState.READY.value:
            logger.info("replica %d ready (pid %d)", slot.index, stats.pid)
        slot.stats = stats
        slot.is_ready = stats.state == EngineState.READY.value
        slot.is_answering = True
        slot.failed_at = None
        if slot.is_ready and slot.listener is None and self._tg is not None:
            slot.listener = anyio.CancelScope()
            self._tg.start_soon(self._listen, slot, slot.listener)

    def _abort_unread(self) -> None:
        """A client that leaves its output unread past client_read_timeout is aborted, as by one process."""
        abort_abandoned([flight.request for flight in self._requests.values()], self.client_read_timeout, self.abort)

    # -- one request ----------------------------------------------------------------------------------------
    def queue(self, shell: Request, request: PreparedRequest) -> OutputStream:
        """Route and submit (Reservation.generate calls this with a slot held): the slot moves from the
        requests being prepared to those in flight."""
        self._ready()
        router = self._router
        assert router is not None and self._tg is not None
        if request.request_id in self._requests:
            raise InvalidRequest(f"request id {request.request_id!r} is already in use")
        ready = [s for s in self._slots if s.is_ready]
        with_room = [s for s in ready if s.num_in_flight < self._places_per_replica] or ready
        hashes = prompt_block_hashes(request.prompt_token_ids, self._block_size) if router.policy == "affine" else []
        route = router.choose(hashes, {s.index: s.load for s in with_room})
        if route is None:
            raise EngineUnavailable(EngineState.LOADING, NO_REPLICA_READY)  # all left between reserve() and now
        slot = self._slots[route.replica]
        shell.bind(request)
        shell.start()  # the replica queues it
        self._num_reserved -= 1
        flight = _InFlight(shell, slot)
        self._requests[request.request_id] = flight
        slot.num_in_flight += 1
        # A grammar matcher cannot travel; the replica compiles its own from params.structured_outputs.
        wire = replace(request, matcher=None) if request.matcher is not None else request
        self._send_soon(slot, wire, flight)
        return OutputStream(shell, self.abort)

    async def _submit(self, slot: ReplicaSlot, batch: list[tuple[PreparedRequest, _InFlight]]) -> None:
        """Send the requests one lap routed to this replica, in one call. One the replica refuses ends alone (full:
        REPLICA_FULL). If the replica fails first (the call raises, or its stream fails while the call travels: Ray
        Serve then holds it for the replacement), each request goes to another ready replica while nothing of it has
        reached the client, else it ends with an error."""
        sent_at = time.monotonic()
        refusals: dict[str, Refusal] = {}
        failure: BaseException | None = None
        scope = anyio.CancelScope()  # _replica_failed cancels it through any of the batch's flights
        for _, flight in batch:
            flight.submit_scope = scope
        with scope:
            try:
                refusals = await slot.handle.submit_many.remote(self._front_id, [request for request, _ in batch])
            except Exception as error:
                failure = error
        for _, flight in batch:
            flight.submit_scope = None
        if failure is None and slot.failed_at is not None and slot.failed_at >= sent_at:
            failure = RuntimeError("the replica failed while the requests travelled")
        if failure is not None:
            self._replica_failed(slot, failure)
        for request, flight in batch:
            request_id = request.request_id
            refusal = refusals.get(request_id)
            if failure is None and refusal is not None:
                self._end(request_id, FinishReason.ERROR, REPLICA_FULL if refusal.is_full else refusal.message)
            elif failure is None:
                flight.is_submitted = True
                if self._requests.get(request_id) is not flight:  # ended while it travelled: the replica has it now
                    self._tell_abort(slot, request_id)
            else:
                self._tell_abort(slot, request_id)  # it may have landed there, or on the replacement
                is_untouched = self._requests.get(request_id) is flight and not flight.num_delivered
                if is_untouched and self._move_to_another(flight):
                    self._send_soon(flight.slot, request, flight)
                elif is_untouched:  # nothing of it ran, and no replica is ready: a 503 that says when to retry
                    self._end(request_id, FinishReason.ERROR, NO_REPLICA_READY, NOT_RUN)
                else:
                    self._end(request_id, FinishReason.ERROR, REPLICA_FAILED)

    def _send_soon(self, slot: ReplicaSlot, request: PreparedRequest, flight: _InFlight) -> None:
        assert self._tg is not None
        self._submits.add(self._tg, slot, (request, flight))

    def _move_to_another(self, flight: _InFlight) -> bool:
        """A request whose submit failed (its replica died, typically before the front noticed) goes to the least
        loaded of the other ready replicas, if any: nothing of it has run, so nothing is lost."""
        others = [s for s in self._slots if s.is_ready and s is not flight.slot]
        if not others:
            return False
        with_room = [s for s in others if s.num_in_flight < self._places_per_replica] or others
        target = min(with_room, key=lambda s: s.load)
        flight.slot.num_in_flight -= 1
        target.num_in_flight += 1
        flight.slot = target
        return True

    async def _listen(self, slot: ReplicaSlot, scope: anyio.CancelScope) -> None:
        """Read the replica's stream of this front's deltas, each item every delta that was ready together; its
        failure (the replica died) ends that replica's requests with an error, and the slot leaves the routing."""
        batches = None
        failure: Exception | None = None
        with scope:
            try:
                batches = slot.handle.options(stream=True).outputs.remote(self._front_id)
                async for batch in batches:
                    for request_id, output in batch:
                        self._deliver(slot, request_id, output)
                failure = RuntimeError("the replica ended its output stream")
            except Exception as error:
                failure = error
            finally:
                if batches is not None:
                    batches.cancel()
                if slot.listener is scope:
                    slot.listener = None
        if failure is not None:
            self._replica_failed(slot, failure)
            # Those still being submitted are left to _submit: one that fails goes to another replica.
            for request_id in [r for r, flight in self._requests.items() if flight.slot is slot and flight.is_submitted]:
                self._end(request_id, FinishReason.ERROR, REPLICA_FAILED)

    def _deliver(self, slot: ReplicaSlot, request_id: str, output: RequestOutput) -> None:
        flight = self._requests.get(request_id)
        if flight is None or flight.slot is not slot:
            return  # ended here already (the replica was told)
        flight.num_delivered += 1
        if not flight.request.push(output):  # the reader is gone
            self._end(request_id, FinishReason.ABORT)
        elif flight.request.is_finished:
            self._count_failure(output.finish_reason)
            self._forget(request_id)

    def _tell_abort(self, slot: ReplicaSlot, request_id: str) -> None:
        if self._tg is not None:  # else the replicas are being shut down, and their requests with them
            self._tg.start_soon(self._abort_there, slot, request_id)

    async def _abort_there(self, slot: ReplicaSlot, request_id: str) -> None:
        with anyio.move_on_after(POLL_TIMEOUT):
            try:
                await slot.handle.abort.remote(self._front_id, request_id)
            except Exception as error:  # the replica is gone, and the request with it
                logger.debug("replica %d: abort of %s not delivered (%s)", slot.index, request_id, error)

    def _replica_failed(self, slot: ReplicaSlot, error: BaseException) -> None:
        if slot.is_ready:
            logger.error("replica %d failed a stream (%s): it leaves the routing until it answers again",
                         slot.index, type(error).__name__)  # fmt: skip
        slot.is_ready = slot.is_answering = False
        slot.failed_at = time.monotonic()
        for flight in self._requests.values():  # a submit there may wait for Ray Serve's replacement: not for it
            if flight.slot is slot and flight.submit_scope is not None:
                flight.submit_scope.cancel()

    def _end(self, request_id: str, reason: FinishReason, error: str | None = None,
             error_code: str | None = None) -> bool:  # fmt: skip
        flight = self._requests.get(request_id)
        if flight is None or flight.request.is_finished:
            self._forget(request_id)
            return False
        flight.request.end(reason, error, error_code)
        self._count_failure(reason)
        if flight.is_submitted and reason is not FinishReason.ERROR:  # an error came from the replica's side
            self._tell_abort(flight.slot, request_id)
        self._forget(request_id)
        return True

    def _count_failure(self, reason: FinishReason | None) -> None:
        if reason is FinishReason.ERROR and self._state is EngineState.DRAINING:
            self._num_failed_draining += 1

    def _forget(self, request_id: str) -> None:
        flight = self._requests.pop(request_id, None)
        if flight is None:
            return
        flight.slot.num_in_flight -= 1
        if not self._requests and self._all_finished:
            self._all_finished.set()

    def _end_everything(self, reason: FinishReason) -> None:
        for request_id in list(self._requests):
            self._end(request_id, reason)

    # -- internals ------------------------------------------------------------------------------------------
    @property
    def _places_per_replica(self) -> int:
        """A replica takes max_num_seqs running plus max_pending queued, as one process does."""
        return self._max_num_seqs + self.max_pending

    def _loaded(self) -> InputProcessor:
        if self._processor is None:
            raise EngineUnavailable(self._state)
        return self._processor

    def _ready(self) -> InputProcessor:
        if self._state is not EngineState.READY or self._processor is None:
            raise EngineUnavailable(self._state)
        if not any(s.is_ready for s in self._slots):
            raise EngineUnavailable(EngineState.LOADING, NO_REPLICA_READY)
        return self._processor


def _take_back_signals() -> None:
    """ray.init installs a native failure handler for SIGTERM that logs a stack and then kills the process: the
    server's own handlers (drain first) are put back in front of it."""
    if threading.current_thread() is not threading.main_thread():
        return  # a server in a thread (tests) takes no signals
    for signum in (signal.SIGTERM, signal.SIGINT):
        handler = signal.getsignal(signum)
        if handler is not None:
            signal.signal(signum, handler)


def _replica_body(slot: ReplicaSlot) -> dict[str, Any]:
    stats = slot.stats
    body: dict[str, Any] = {
        "index": slot.index,
        "ready": slot.is_ready,
        "in_flight": slot.num_in_flight,
        "restarts": slot.num_restarts,
    }
    if stats is not None and not slot.is_answering:  # its last report is from before it failed or went quiet
        body.update(pid=stats.pid, state="unavailable")
    elif stats is not None:
        body.update(
            pid=stats.pid,
            state=stats.state,
            running=stats.running,
            waiting=stats.waiting,
            pending=stats.pending,
            load=stats.load,
            free_kv_blocks=stats.free_kv_blocks,
            total_kv_blocks=stats.total_kv_blocks,
            prefix_cache_hit_rate=round(stats.prefix_cache_hit_rate, 4),
            prefix_queries=stats.num_prefix_queries,
            prefix_hits=stats.num_prefix_hits,
        )
    return body
