"""The front's bookkeeping of its replicas (web/cluster/front.py, no Ray: fake handles): the requests of one lap to one
replica leave in one call, a request whose submit fails goes to another ready replica, a request the replica refuses
ends alone, no ready replica means 503 "loading", and a replica that failed shows no stale load."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from quart import Quart

from engine.async_engine import EngineState, EngineUnavailable
from engine.config import ClusterConfig, SluiceConfig
from engine.input_processor import PreparedRequest
from engine.outputs import NOT_RUN, FinishReason, RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.speculative.stats import ProposerCounts
from web.cluster.front import (
    NO_REPLICA_READY,
    REPLICA_FAILED,
    REPLICA_FULL,
    ClusterEngine,
    ReplicaSlot,
    _InFlight,
    _replica_body,
)
from web.cluster.router import Router
from web.cluster.stats import ReplicaStats
from web.cluster.submit_batches import Refusal
from web.errors import failure_of


class FakeCall:
    def __init__(self, handle: FakeHandle, name: str) -> None:
        self.handle, self.name = handle, name

    async def remote(self, front_id: str, payload: Any) -> dict[str, Refusal]:
        if self.handle.during_call is not None:
            self.handle.during_call()
        if self.handle.is_dead:
            raise RuntimeError("the actor died")
        request_ids = [r.request_id for r in payload] if self.name == "submit" else [payload]
        if self.name == "submit":
            self.handle.batches.append(request_ids)
        self.handle.calls += [(self.name, request_id) for request_id in request_ids]
        return {r: self.handle.refusals[r] for r in request_ids if r in self.handle.refusals}


class FakeHandle:
    def __init__(self, is_dead: bool = False) -> None:
        self.is_dead = is_dead
        self.during_call: Any = None  # called while a call travels
        self.calls: list[tuple[str, str]] = []  # (method, request id), a submitted batch's request by request
        self.batches: list[list[str]] = []  # each submit_many call's request ids
        self.refusals: dict[str, Refusal] = {}  # what submit_many answers for these request ids
        self.submit_many, self.abort = FakeCall(self, "submit"), FakeCall(self, "abort")


class FakeRequest:
    def __init__(self) -> None:
        self.ended: tuple[FinishReason, str | None] | None = None
        self.error_code: str | None = None

    @property
    def is_finished(self) -> bool:
        return self.ended is not None

    def end(self, reason: FinishReason, error: str | None = None, error_code: str | None = None) -> None:
        self.ended, self.error_code = (reason, error), error_code

    def push(self, output: RequestOutput) -> bool:  # a replica's delta, read at once
        if output.finished:
            self.ended = (output.finish_reason, output.error)
        return True


def front_with(*slots: ReplicaSlot) -> ClusterEngine:
    engine = ClusterEngine(SluiceConfig())
    engine._slots = list(slots)
    engine._max_num_seqs = 4
    engine._state = EngineState.READY
    return engine


async def submit(engine: ClusterEngine, *flights: _InFlight) -> None:
    """The flights (request ids r, r1, r2...) in one batch to the first one's replica."""
    batch = []
    for number, flight in enumerate(flights):
        request_id = f"r{number or ''}"
        engine._requests[request_id] = flight
        flight.slot.num_in_flight += 1
        batch.append((SimpleNamespace(request_id=request_id), flight))
    async with anyio.create_task_group() as tg:
        engine._tg = tg
        await engine._submit(flights[0].slot, batch)  # type: ignore[arg-type]
    engine._tg = None


def test_a_submit_to_a_replica_that_just_died_goes_to_another() -> None:
    dead, alive = ReplicaSlot(0, FakeHandle(is_dead=True), is_ready=True), ReplicaSlot(1, FakeHandle(), is_ready=True)
    engine = front_with(dead, alive)
    flight = _InFlight(FakeRequest(), dead)  # type: ignore[arg-type]
    anyio.run(submit, engine, flight)
    assert flight.slot is alive and flight.is_submitted and alive.handle.calls == [("submit", "r")]
    assert flight.request.ended is None  # type: ignore[attr-defined]
    assert (dead.num_in_flight, alive.num_in_flight) == (0, 1) and not dead.is_ready


def test_a_submit_that_fails_with_no_other_replica_ends_as_not_run_and_the_client_gets_503_with_retry_after() -> None:
    """Nothing of it ran (every replica failed before it could): the answer is OpenAI's "try again", not a 500."""
    dead = ReplicaSlot(0, FakeHandle(is_dead=True), is_ready=True)
    engine = front_with(dead)
    flight = _InFlight(FakeRequest(), dead)  # type: ignore[arg-type]
    anyio.run(submit, engine, flight)
    request: FakeRequest = flight.request  # type: ignore[assignment]
    assert request.ended == (FinishReason.ERROR, NO_REPLICA_READY) and request.error_code == NOT_RUN
    assert dead.num_in_flight == 0 and not engine._requests
    app = Quart(__name__)
    app.extensions["sluice"] = SimpleNamespace(config=SimpleNamespace(retry_after_seconds=1))

    async def answer_to(output: RequestOutput) -> Any:
        async with app.app_context():  # as the route turns the final output into its answer
            return failure_of(output)

    final = RequestOutput("r", [], "", True, FinishReason.ERROR, error=NO_REPLICA_READY, error_code=NOT_RUN)
    answer = anyio.run(answer_to, final)
    assert (answer.status, answer.code, answer.headers) == (503, "engine_loading", {"Retry-After": "1"})
    assert failure_of(RequestOutput("r", [], "", True, FinishReason.ERROR, error=REPLICA_FAILED)).status == 500


def test_a_submit_that_fails_after_deltas_came_back_with_no_other_replica_ends_with_an_error() -> None:
    dead = ReplicaSlot(0, FakeHandle(is_dead=True), is_ready=True)
    engine = front_with(dead)
    flight = _InFlight(FakeRequest(), dead, num_delivered=1)  # type: ignore[arg-type]
    anyio.run(submit, engine, flight)
    request: FakeRequest = flight.request  # type: ignore[assignment]
    assert request.ended == (FinishReason.ERROR, REPLICA_FAILED) and request.error_code is None


def test_a_submit_that_lands_after_its_replicas_stream_failed_goes_to_another_and_is_aborted_there() -> None:
    """Ray Serve holds a call to a dead replica for its replacement: the request may land there, unread."""
    slot, other = ReplicaSlot(0, FakeHandle(), is_ready=True), ReplicaSlot(1, FakeHandle(), is_ready=True)
    engine = front_with(slot, other)
    slot.handle.during_call = lambda: engine._replica_failed(slot, RuntimeError("its stream failed"))
    flight = _InFlight(FakeRequest(), slot)  # type: ignore[arg-type]
    anyio.run(submit, engine, flight)
    assert flight.slot is other and flight.is_submitted and other.handle.calls == [("submit", "r")]
    assert ("abort", "r") in slot.handle.calls and flight.request.ended is None  # type: ignore[attr-defined]
    assert (slot.num_in_flight, other.num_in_flight) == (0, 1)


def test_a_submit_waiting_on_a_replica_that_fails_is_cancelled_and_sent_elsewhere() -> None:
    slot, other = ReplicaSlot(0, FakeHandle(), is_ready=True), ReplicaSlot(1, FakeHandle(), is_ready=True)
    engine = front_with(slot, other)
    flight = _InFlight(FakeRequest(), slot)  # type: ignore[arg-type]
    held = anyio.Event()

    async def wait_forever() -> None:  # the call Ray Serve holds for a replacement
        held.set()
        await anyio.sleep_forever()

    async def scenario() -> None:
        slot.handle.submit_many.remote = lambda front_id, requests: wait_forever()  # type: ignore[method-assign]
        async with anyio.create_task_group() as tg:
            tg.start_soon(submit, engine, flight)
            await held.wait()
            engine._replica_failed(slot, RuntimeError("its output stream failed"))

    anyio.run(scenario)
    assert flight.slot is other and flight.is_submitted and other.handle.calls == [("submit", "r")]


def test_the_requests_of_one_lap_to_one_replica_leave_in_one_call_and_a_refusal_ends_only_its_own() -> None:
    """Each Ray call wakes Ray Serve's router thread: a wave of requests costs one call a replica, not one each. A
    request its replica did not queue (full, or a failure of its own) ends alone, and the replica stays routed."""
    first, second = ReplicaSlot(0, FakeHandle(), is_ready=True), ReplicaSlot(1, FakeHandle(), is_ready=True)
    engine = front_with(first, second)
    engine._router = Router("round_robin", 2, memory_blocks=16)
    engine._processor = object()  # type: ignore[assignment]
    first.handle.refusals["r2"] = Refusal(is_full=False, message="ValueError: no grammar")
    second.handle.refusals["r3"] = Refusal(is_full=True, message="the queue is full")
    shells = [Request() for _ in range(4)]

    async def scenario() -> list[tuple[FinishReason | None, str | None] | None]:
        async with anyio.create_task_group() as tg:
            engine._tg, engine._num_reserved = tg, len(shells)
            # in one lap; round robin: r0 and r2 to the first replica
            streams = [engine.queue(shell, PreparedRequest(f"r{number}", [1, 2, 3], SamplingParams(max_tokens=4), 4))
                       for number, shell in enumerate(shells)]  # fmt: skip
        ends = [await anext(stream) if stream.request.is_finished else None for stream in streams]
        return [(end.finish_reason, end.error) if end is not None else None for end in ends]

    ends = anyio.run(scenario)
    assert first.handle.batches == [["r0", "r2"]] and second.handle.batches == [["r1", "r3"]]
    assert ends == [None, None, (FinishReason.ERROR, "ValueError: no grammar"), (FinishReason.ERROR, REPLICA_FULL)]
    assert first.is_ready and second.is_ready and sorted(engine._requests) == ["r0", "r1"]
    assert all(engine._requests[r].is_submitted for r in ("r0", "r1"))


def test_a_batch_whose_replica_died_goes_on_in_one_call_but_a_request_already_answered_ends() -> None:
    dead, alive = ReplicaSlot(0, FakeHandle(is_dead=True), is_ready=True), ReplicaSlot(1, FakeHandle(), is_ready=True)
    engine = front_with(dead, alive)
    flights = [_InFlight(FakeRequest(), dead) for _ in range(3)]  # type: ignore[arg-type]
    flights[2].num_delivered = 1  # its first deltas came back before the call failed: it cannot start again
    anyio.run(submit, engine, *flights)
    assert alive.handle.batches == [["r", "r1"]] and all(f.slot is alive and f.is_submitted for f in flights[:2])
    ends = [f.request.ended for f in flights]  # type: ignore[attr-defined]
    assert ends == [None, None, (FinishReason.ERROR, REPLICA_FAILED)]
    assert (dead.num_in_flight, alive.num_in_flight) == (0, 2) and not dead.is_ready


def test_no_ready_replica_is_503_loading_in_health_and_admission() -> None:
    engine = front_with(ReplicaSlot(0, FakeHandle(), is_ready=False), ReplicaSlot(1, FakeHandle(), is_ready=False))
    engine._processor = object()  # type: ignore[assignment]  # loaded once: only the replicas are missing
    assert engine.stats().state == EngineState.LOADING.value and engine.stats().num_ready == 0
    with pytest.raises(EngineUnavailable, match="no replica is ready") as refusal:
        engine.reserve()
    assert refusal.value.state is EngineState.LOADING
    engine._slots[1].is_ready = True
    assert engine.stats().state == EngineState.READY.value


def test_a_replica_that_failed_shows_no_stale_load() -> None:
    stats = ReplicaStats(pid=42, state="ready", running=5, waiting=1, pending=0, free_kv_blocks=10,
                         total_kv_blocks=20, num_prefix_queries=0, num_prefix_hits=0)  # fmt: skip
    slot = ReplicaSlot(0, FakeHandle(), stats=stats, is_ready=True, is_answering=True)
    assert _replica_body(slot)["load"] == 6
    front_with(slot)._replica_failed(slot, RuntimeError("gone"))
    body = _replica_body(slot)
    assert body["state"] == "unavailable" and body["pid"] == 42 and "load" not in body and not body["ready"]


def answer_stats_from(reports: dict[int, list[ReplicaStats | None]], *slots: ReplicaSlot) -> None:
    """Each slot's handle answers stats() with its replica's next report (None: the actor died)."""

    async def answer(index: int) -> ReplicaStats:
        stats = reports[index].pop(0)
        if stats is None:
            raise RuntimeError("the actor died")
        return stats

    for s in slots:
        s.handle.stats = SimpleNamespace(remote=partial(answer, s.index))


def test_the_preemption_count_never_goes_down_when_a_replica_is_replaced() -> None:
    """A Prometheus counter only goes up: a replica that dies keeps its count, and its replacement's adds to it."""

    def report(pid: int, state: str, num_preemptions: int) -> ReplicaStats:
        return ReplicaStats(pid=pid, state=state, running=0, waiting=0, pending=0, free_kv_blocks=1,
                            total_kv_blocks=1, num_prefix_queries=0, num_prefix_hits=0,
                            num_preemptions=num_preemptions)  # fmt: skip

    slot, other = ReplicaSlot(0, FakeHandle()), ReplicaSlot(1, FakeHandle())
    engine = front_with(slot, other)
    reports = {0: [report(7, "ready", 4), None, report(8, "loading", 0), report(8, "ready", 3)],
               1: [report(9, "ready", 4)] * 4}  # fmt: skip
    answer_stats_from(reports, slot, other)
    seen = []
    for _ in range(4):
        anyio.run(engine._poll_once)
        seen.append(engine.stats().num_preemptions)
    assert seen == [8, 8, 8, 11] and slot.num_restarts == 1


def test_speculation_counters_are_summed_over_replicas_and_never_go_down() -> None:
    """/metrics' sluice_speculative_*_total with replicas: every replica's counts, a replaced one's kept (they were
    missing altogether: the front reported no speculation)."""

    def report(pid: int, num_accepted: int) -> ReplicaStats:
        counts = {"prompt": ProposerCounts(num_steps=1, num_draft_tokens=8, num_accepted_tokens=num_accepted,
                                           num_emitted_tokens=num_accepted + 1), "recent": ProposerCounts()}
        return ReplicaStats(pid=pid, state="ready", running=0, waiting=0, pending=0, free_kv_blocks=1,
                            total_kv_blocks=1, num_prefix_queries=0, num_prefix_hits=0, speculation=counts)  # fmt: skip

    slot, other = ReplicaSlot(0, FakeHandle()), ReplicaSlot(1, FakeHandle())
    engine = front_with(slot, other)
    reports = {0: [report(7, 5), None, report(8, 2)], 1: [report(9, 3)] * 3}
    answer_stats_from(reports, slot, other)
    seen = []
    for _ in range(3):
        anyio.run(engine._poll_once)
        speculation = engine.stats().speculation or {}
        seen.append((speculation["prompt"].num_accepted_tokens, speculation["prompt"].num_steps,
                     speculation["recent"].num_steps))  # fmt: skip
    assert seen == [(8, 2, 0), (8, 2, 0), (10, 3, 0)]


def drain_log(caplog, num_requests: int, meanwhile: Callable[[ClusterEngine, ReplicaSlot], None]) -> list[str]:
    """The drain's log line(s) for num_requests in flight on one replica (r, r1, ...), `meanwhile` run 0.1 s into
    the drain, then the lifespan's second drain."""
    slot = ReplicaSlot(0, FakeHandle(), is_ready=True)
    engine = front_with(slot)
    for number in range(num_requests):
        engine._requests[f"r{number or ''}"] = _InFlight(FakeRequest(), slot, is_submitted=True)  # type: ignore[arg-type]
        slot.num_in_flight += 1

    async def scenario() -> None:
        async with anyio.create_task_group() as tg:
            engine._tg = tg
            tg.start_soon(engine.drain, 30)
            await anyio.sleep(0.1)
            meanwhile(engine, slot)
        await engine.drain(30)

    with caplog.at_level(logging.INFO, logger="engine.async_engine"):
        anyio.run(scenario)
    assert slot.num_in_flight == 0
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("drain:")]


def test_a_drain_ended_by_a_second_signal_says_so_once(caplog) -> None:
    """The front's requests are forgotten as they end: a drain cut short by a second stop signal logged them as
    "finished", and the lifespan's second drain logged nothing of them."""
    drained = drain_log(caplog, 1, lambda engine, _: engine.abort_all())  # the second SIGTERM / SIGINT
    assert drained == ["drain: 0 of 1 requests in flight finished, 1 ended with finish_reason 'abort' at a second "
                       "stop signal"]  # fmt: skip


def test_a_drain_says_how_many_of_the_finished_requests_failed(caplog) -> None:
    """A replica that dies under a drain ends its streams with an error: the drain's log does not call them finished
    like the others."""

    def one_fails_one_finishes(engine: ClusterEngine, slot: ReplicaSlot) -> None:
        engine._end("r", FinishReason.ERROR, REPLICA_FAILED)  # its replica died
        engine._deliver(slot, "r1", RequestOutput("r1", [], "", True, FinishReason.LENGTH))

    drained = drain_log(caplog, 2, one_fails_one_finishes)
    assert drained == ["drain: 2 of 2 requests in flight finished (1 of them with an error), 0 ended with "
                       "finish_reason 'abort' at drain_timeout (30 s)"]  # fmt: skip


def test_replicas_without_ray_installed_is_one_line_saying_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """It was the engine loop's 30-line traceback of a ModuleNotFoundError."""
    import sys

    for name in ("web.cluster.launch", "web.cluster.replica"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: `import ray` raises ModuleNotFoundError
    engine = ClusterEngine(SluiceConfig(cluster=ClusterConfig(replicas=2)))
    with pytest.raises(ValueError, match=r"^replicas = 2 needs Ray Serve: pip install -e '\.\[cluster\]' \(.*ray"):
        anyio.run(engine._start)


class StartingReplica:
    """A replica's handle while the replicas start: its reports say `state`; its output stream fails once Ray is shut
    down (Serve kills the replica), as a real one's does."""

    def __init__(self, state: str, shutdowns: list[str]) -> None:
        self.report = ReplicaStats(pid=7, state=state, running=0, waiting=0, pending=0, free_kv_blocks=1,
                                   total_kv_blocks=1, num_prefix_queries=0, num_prefix_hits=0)  # fmt: skip
        self.shutdowns = shutdowns
        self.stats = SimpleNamespace(remote=self._report)
        self.outputs = SimpleNamespace(remote=lambda front_id: self)

    async def _report(self) -> ReplicaStats:
        return self.report

    def options(self, stream: bool) -> StartingReplica:
        return self

    def __aiter__(self) -> StartingReplica:
        return self

    async def __anext__(self) -> Any:
        while not self.shutdowns:
            await anyio.sleep(0.01)
        raise RuntimeError("the actor died")

    def cancel(self) -> None:
        pass


@pytest.mark.parametrize("stop_during", ["ray_start", "replicas_load"])
def test_a_stop_during_the_start_stops_what_was_started_and_is_no_failure(stop_during: str, caplog) -> None:
    """SIGTERM while ray.init ran in its thread: the start was abandoned, nothing stopped the Ray it went on to start,
    and the process lingered a minute after "stopped: exit 0" and exited 1 ("Failed to connect to GCS"). SIGTERM
    while the replicas loaded: the engine's run returned without reporting started, which the host logged as "the
    engine loop failed" with a traceback, and a replica ready by then was logged as failed when Ray's shutdown ended
    its stream. The host's order: drain, then cancel."""
    is_launching, may_return = threading.Event(), threading.Event()
    shutdowns: list[str] = []
    handles = [StartingReplica("ready", shutdowns), StartingReplica("loading", shutdowns)]

    def launch(config: SluiceConfig) -> SimpleNamespace:  # ray.init and Serve's start: not to be interrupted
        is_launching.set()
        may_return.wait(10)
        return SimpleNamespace(handles=handles, shutdown=shutdown, raise_if_failed=lambda: None)

    def shutdown() -> None:  # Serve's and Ray's: seconds, in which the engine's start sees the stop
        time.sleep(0.5)
        shutdowns.append("shutdown")

    engine = ClusterEngine(SluiceConfig(cluster=ClusterConfig(replicas=2)), launch=launch)
    if stop_during == "replicas_load":
        may_return.set()

    async def host() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(tg.start, engine.run))  # as web/asgi.py starts it: an error there fails the test
            await anyio.to_thread.run_sync(is_launching.wait)
            await anyio.sleep(0.3)  # the replicas are polled meanwhile, once launched
            threading.Timer(0.3, may_return.set).start()
            await engine.drain(0)
            await anyio.sleep(0.3)  # Hypercorn stops, then the lifespan's shutdown cancels
            tg.cancel_scope.cancel()

    with caplog.at_level(logging.WARNING, logger="sluice.cluster"):
        anyio.run(host)
    assert shutdowns == ["shutdown"] and engine.state is EngineState.STOPPED
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
