"""AsyncEngine on the real engine with the tiny model: preparation, admission, delivery, abort, drain, the
watchdog, slow readers and failures."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import pytest

from engine.async_engine import AsyncEngine, EngineState, EngineUnavailable, QueueFull
from engine.errors import InvalidRequest
from engine.input_processor import PreparedRequest
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request import OutputStream
from engine.sampling_params import SamplingParams
from engine.structured_outputs import StructuredOutputs

from tests.support.engine_helpers import slow_steps
from tests.support.server_harness import tiny_engine_config

pytestmark = pytest.mark.anyio
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def make_engine(tiny_llama_dir) -> Callable[..., LLMEngine]:
    return lambda **overrides: LLMEngine(tiny_engine_config(tiny_llama_dir, **overrides))


@asynccontextmanager
async def running(engine: LLMEngine, max_pending: int = 8, **options: Any) -> AsyncIterator[AsyncEngine]:
    async_engine = AsyncEngine(lambda: engine, max_pending=max_pending, **options)
    async with anyio.create_task_group() as tg:
        await tg.start(async_engine.run)
        yield async_engine
        await async_engine.drain(timeout=5)


def prepared(engine: LLMEngine, request_id: str, prompt: str | list[int], **params: Any) -> PreparedRequest:
    return engine.input_processor.process_prompt(request_id, prompt, SamplingParams(**params))


async def collect(stream: OutputStream) -> list[RequestOutput]:
    return [output async for output in stream]


def offline_text(engine: LLMEngine, prompt: str, params: SamplingParams) -> str:
    engine.add_request("offline", prompt, params)
    text = ""
    while engine.has_unfinished_requests:
        text += "".join(o.text_delta for o in engine.step())
    return text


async def test_results_match_the_offline_engine_and_end_once(make_engine) -> None:
    engine = make_engine()
    prompts = ("Hello world", "The quick brown fox", "Paged attention")
    params = SamplingParams(max_tokens=12, **GREEDY)
    expected = [offline_text(engine, p, params) for p in prompts]
    async with running(engine) as async_engine:
        requests = [await async_engine.prepare_prompt(f"r{i}", p, params) for i, p in enumerate(prompts)]
        streams = [async_engine.generate(r) for r in requests]
        results: list[list[RequestOutput]] = [[] for _ in streams]

        async def read(i: int) -> None:
            results[i] = await collect(streams[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(streams)):
                tg.start_soon(read, i)
    for outputs, text in zip(results, expected):
        assert "".join(o.text_delta for o in outputs) == text
        assert [o.finished for o in outputs].count(True) == 1 and outputs[-1].finished
        assert outputs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outputs) == 12


async def test_bad_input_is_rejected_while_preparing_naming_the_parameter(make_engine) -> None:
    engine = make_engine()
    async with running(engine) as async_engine:
        with pytest.raises(InvalidRequest, match=r"500.*512|512.*500") as raised:
            await async_engine.prepare_prompt("long", [5] * 500, SamplingParams(max_tokens=100))
        assert raised.value.param == "max_tokens"
        with pytest.raises(InvalidRequest) as raised:
            await async_engine.prepare_prompt("min", "hi", SamplingParams(max_tokens=None, min_tokens=10**9))
        assert raised.value.param == "min_tokens"
        with pytest.raises(InvalidRequest) as raised:
            await async_engine.prepare_chat("chat", [{"role": "user", "content": "x" * 10**7}], SamplingParams())
        assert raised.value.param == "messages"
        assert async_engine.stats().pending == 0


async def test_queue_full_when_the_scheduler_has_no_room(make_engine) -> None:
    engine = make_engine(max_num_seqs=1, max_num_batched_tokens=64)
    async with running(engine, max_pending=2) as async_engine:
        blocker = async_engine.generate(prepared(engine, "blocker", "Hello world", max_tokens=200, **GREEDY))
        await anyio.sleep(0.05)  # the loop takes it: the scheduler is now full
        queued = [async_engine.generate(prepared(engine, f"q{i}", "Hello", max_tokens=2, **GREEDY)) for i in range(2)]
        with pytest.raises(QueueFull):
            async_engine.generate(prepared(engine, "rejected", "Hello", max_tokens=2))
        assert async_engine.stats().pending == 2
        for stream in (blocker, *queued):
            assert (await collect(stream))[-1].finish_reason == "length"


async def test_slots_are_reserved_before_preparation_and_given_back_unspent(make_engine) -> None:
    """The 429 is decided before any tokenizing: requests being prepared hold their slots, and a request that
    fails its checks (or whose client leaves) returns its unspent ones."""
    engine = make_engine(max_num_seqs=1, max_num_batched_tokens=64)
    async with running(engine, max_pending=2) as async_engine:  # 3 slots: max_pending and the scheduler's free place
        with async_engine.reserve(2) as reservation:
            assert async_engine.stats().pending == 2
            with pytest.raises(QueueFull):
                async_engine.reserve(2)
            with async_engine.reserve(1):
                with pytest.raises(QueueFull):
                    async_engine.reserve(1)
            stream = reservation.generate(prepared(engine, "a", "Hello", max_tokens=2, **GREEDY))
            with pytest.raises(InvalidRequest):  # a duplicate id spends nothing
                reservation.generate(prepared(engine, "a", "Hello", max_tokens=2, **GREEDY))
            assert reservation.num_held == 1
        assert (await collect(stream))[-1].finish_reason == "length"
        assert async_engine.stats().pending == 0
        with async_engine.reserve(3):
            pass  # every slot is back
        await async_engine.drain(timeout=5)
        with pytest.raises(EngineUnavailable):
            async_engine.reserve(1)


async def test_a_burst_fills_the_schedulers_free_places_before_max_pending(make_engine) -> None:
    """Requests that come during a step wait for the loop to take them between steps: the scheduler's free places
    take a burst first, and only what would wait beyond them counts against max_pending (a burst of 100 with 64
    free places and max_pending 16 got 68 429s)."""
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=64)
    slow_steps(engine, 0.02)
    async with running(engine, max_pending=2) as async_engine:
        streams = [async_engine.generate(prepared(engine, f"b{i}", "Hello", max_tokens=3, **GREEDY)) for i in range(6)]
        with pytest.raises(QueueFull):  # 4 free places + max_pending 2
            async_engine.generate(prepared(engine, "b6", "Hello", max_tokens=3))
        assert async_engine.stats().pending == 6
        with anyio.fail_after(5):
            while async_engine.stats().running < 4:
                await anyio.sleep(0.005)
        assert async_engine.stats().pending == 2  # the loop took 4; the scheduler is full, max_pending is full
        with pytest.raises(QueueFull):
            async_engine.generate(prepared(engine, "b7", "Hello", max_tokens=3))
        for stream in streams:
            assert (await collect(stream))[-1].finish_reason == "length"
        assert async_engine.stats().pending == 0
    assert engine.num_free_blocks == engine.num_total_blocks


async def test_the_free_places_admit_requests_by_their_choices(make_engine) -> None:
    """A request of n choices takes n of the scheduler's free places: 4 free places take one request of n = 4,
    not four (a burst of n = 8 requests once left 11 waiting against max_pending 4)."""
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=64)
    async with running(engine, max_pending=1) as async_engine:
        with async_engine.reserve(1, num_choices=4), async_engine.reserve(1, num_choices=4):
            with pytest.raises(QueueFull) as full:
                async_engine.reserve(1, num_choices=4)
            assert "(1 for this request now) and max_pending (1) more" in str(full.value)
        with async_engine.reserve(5):  # one choice each: the 4 places and max_pending
            pass


async def test_a_queued_abort_frees_its_admission_slot_at_once(make_engine) -> None:
    engine = make_engine(max_num_seqs=1, max_num_batched_tokens=64)
    slow_steps(engine, 0.01)
    async with running(engine, max_pending=2) as async_engine:
        blocker = async_engine.generate(prepared(engine, "blocker", "Hello world", max_tokens=100, **GREEDY))
        await anyio.sleep(0.05)
        for i in range(2):
            async_engine.generate(prepared(engine, f"gone{i}", "Hello", max_tokens=2, **GREEDY))
        with pytest.raises(QueueFull):
            async_engine.generate(prepared(engine, "full", "Hello", max_tokens=2))
        assert async_engine.abort("gone0") and async_engine.abort("gone1")
        assert async_engine.stats().pending == 0  # exactly the slots in use, no lag
        admitted = [async_engine.generate(prepared(engine, f"next{i}", "Hello", max_tokens=2, **GREEDY)) for i in range(2)]
        async_engine.abort("blocker")
        assert (await collect(blocker))[-1].finish_reason == "abort"
        for stream in admitted:
            assert (await collect(stream))[-1].finish_reason == "length"
    assert engine.num_free_blocks == engine.num_total_blocks


async def test_abort_while_queued_and_while_running(make_engine) -> None:
    engine = make_engine(max_num_seqs=1, max_num_batched_tokens=64)
    async with running(engine) as async_engine:
        running_stream = async_engine.generate(prepared(engine, "running", "Hello world", max_tokens=400, **GREEDY))
        queued = async_engine.generate(prepared(engine, "queued", "Hello world", max_tokens=4, **GREEDY))
        await anyio.sleep(0.05)
        assert async_engine.abort("queued") and not async_engine.abort("queued")
        assert (await collect(queued))[-1].finish_reason == "abort"
        first = await running_stream.__anext__()
        assert not first.finished
        assert async_engine.abort("running")
        rest = await collect(running_stream)
        assert rest[-1].finish_reason == "abort" and [o.finished for o in rest].count(True) == 1
        after = async_engine.generate(prepared(engine, "after", "Hello world", max_tokens=3, **GREEDY))
        assert (await collect(after))[-1].finish_reason == "length"
        assert engine.num_free_blocks == engine.num_total_blocks


async def test_an_abort_during_a_forward_pass_is_applied_after_it(make_engine) -> None:
    engine = make_engine()
    in_pass, release = threading.Event(), threading.Event()
    real_execute = engine.execute

    def gated_execute(plan: Any) -> Any:
        in_pass.set()
        release.wait(10)
        return real_execute(plan)

    engine.execute = gated_execute  # type: ignore[method-assign]
    async with running(engine) as async_engine:
        stream = async_engine.generate(prepared(engine, "x", "Hello world", max_tokens=50, **GREEDY))
        await anyio.to_thread.run_sync(in_pass.wait, 10)
        assert async_engine.abort("x")  # the forward pass is running now: nothing is freed under it
        assert engine.num_running == 1
        release.set()
        assert (await collect(stream))[-1].finish_reason == "abort"
        with anyio.fail_after(5):
            while engine.has_unfinished_requests:
                await anyio.sleep(0.01)
        assert engine.num_free_blocks == engine.num_total_blocks


async def test_closed_reader_is_aborted(make_engine) -> None:
    engine = make_engine()
    async with running(engine) as async_engine:
        stream = async_engine.generate(prepared(engine, "gone", "Hello world", max_tokens=400, **GREEDY))
        await stream.__anext__()
        stream.close()
        with anyio.fail_after(5):
            while engine.has_unfinished_requests:
                await anyio.sleep(0.01)
        assert engine.num_free_blocks == engine.num_total_blocks


async def test_an_unread_stream_holds_one_merged_delta_then_is_aborted(make_engine) -> None:
    engine = make_engine()
    slow_steps(engine, 0.01)  # 400 tokens take seconds: longer than the read timeout
    async with running(engine, client_read_timeout=0.5) as async_engine:
        stream = async_engine.generate(prepared(engine, "unread", "Hello world", max_tokens=400, **GREEDY))
        timed_out: list[bool] = []
        stream.request.on_read_timeout = lambda: timed_out.append(True)
        with anyio.fail_after(10):
            while not stream.request.is_finished or engine.has_unfinished_requests:
                await anyio.sleep(0.01)
        assert timed_out == [True]
        outputs = await collect(stream)
        assert len(outputs) == 1  # everything it never read, merged into one delta, ending in the abort
        assert outputs[0].finished and outputs[0].finish_reason == "abort"
        assert len(outputs[0].new_token_ids) == outputs[0].num_output_tokens > 1
        assert engine.num_free_blocks == engine.num_total_blocks


async def test_drain_finishes_in_flight_then_aborts_the_rest(make_engine) -> None:
    engine = make_engine()
    slow_steps(engine, 0.01)  # the long request takes seconds: the drain deadline always cuts it
    async_engine = AsyncEngine(lambda: engine, max_pending=8)
    async with anyio.create_task_group() as tg:
        await tg.start(async_engine.run)
        short = async_engine.generate(prepared(engine, "short", "Hello world", max_tokens=3, **GREEDY))
        long = async_engine.generate(prepared(engine, "long", "Hello world", max_tokens=450, **GREEDY))
        results: dict[str, list[RequestOutput]] = {}

        async def read(name: str, stream: OutputStream) -> None:
            results[name] = await collect(stream)

        tg.start_soon(read, "short", short)
        tg.start_soon(read, "long", long)
        await async_engine.drain(timeout=0.5)
        with pytest.raises(EngineUnavailable):
            async_engine.generate(prepared(engine, "late", "Hello", max_tokens=3))
    assert results["short"][-1].finish_reason == "length"
    assert results["long"][-1].finish_reason == "abort"
    assert async_engine.state is EngineState.STOPPED
    assert engine.num_free_blocks == engine.num_total_blocks


async def test_a_drain_ended_by_a_second_signal_says_so_once(make_engine, caplog) -> None:
    # The log said "ended with finish_reason 'abort' at drain_timeout (30 s)" one second into the drain, twice: once
    # for the signal's drain, once for the lifespan's second drain, whose requests had all ended already.
    engine = make_engine()
    slow_steps(engine, 0.01)
    async_engine = AsyncEngine(lambda: engine, max_pending=8)
    with caplog.at_level(logging.INFO, logger="engine.async_engine"):
        async with anyio.create_task_group() as tg:
            await tg.start(async_engine.run)
            short = async_engine.generate(prepared(engine, "short", "Hello world", max_tokens=2, **GREEDY))
            long = async_engine.generate(prepared(engine, "long", "Hello world", max_tokens=450, **GREEDY))
            tg.start_soon(collect, long)
            await collect(short)
            tg.start_soon(async_engine.drain, 30)
            await anyio.sleep(0.2)
            async_engine.abort_all()  # the second SIGTERM / SIGINT
            await async_engine.drain(30)  # the lifespan's shutdown drains again
    drained = [r.getMessage() for r in caplog.records if r.getMessage().startswith("drain:")]
    assert drained == ["drain: 0 of 1 requests in flight finished, 1 ended with finish_reason 'abort' at a second "
                       "stop signal"]  # fmt: skip
    assert engine.num_free_blocks == engine.num_total_blocks


async def test_a_stalled_step_ends_every_stream_and_stops_the_loop(make_engine) -> None:
    engine = make_engine()
    release = threading.Event()
    real_execute = engine.execute

    def hanging_execute(plan: Any) -> Any:
        release.wait(30)  # an injected hang
        return real_execute(plan)

    engine.execute = hanging_execute  # type: ignore[method-assign]
    abandoned: list[bool] = []
    async_engine = AsyncEngine(
        lambda: engine, max_pending=8, step_timeout=0.5, on_forward_abandoned=lambda: abandoned.append(True)
    )
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(async_engine.run)
                streams = [async_engine.generate(prepared(engine, f"r{i}", "Hello", max_tokens=5)) for i in range(2)]
                queued = async_engine.generate(prepared(engine, "queued", "Hello", max_tokens=5))
                outputs = [await collect(s) for s in (*streams, queued)]
        assert async_engine.state is EngineState.STALLED and abandoned == [True]
        assert async_engine.stats().state == "stalled"
        for stream_outputs in outputs:
            assert [o.finish_reason for o in stream_outputs] == ["error"] and "stalled" in stream_outputs[0].error
        with pytest.raises(EngineUnavailable):
            async_engine.generate(prepared(engine, "late", "Hello", max_tokens=3))
    finally:
        release.set()


async def test_time_the_process_was_stopped_is_not_a_stalled_step(make_engine) -> None:
    """SIGSTOP (a paused container or VM) for 2.5 s in the middle of a forward pass, step_timeout 1 s: the pass
    goes on after SIGCONT and the streams finish (the watchdog took the paused time for a stall)."""
    engine = make_engine()
    real_execute = engine.execute
    paused: list[subprocess.Popen] = []

    def execute_with_a_pause(plan: Any) -> Any:
        if not paused:
            paused.append(subprocess.Popen(["sh", "-c", f"sleep 2.5; kill -CONT {os.getpid()}"]))
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(0.5)  # still running when the watchdog first looks after the pause
        return real_execute(plan)

    engine.execute = execute_with_a_pause  # type: ignore[method-assign]
    async_engine = AsyncEngine(lambda: engine, max_pending=8, step_timeout=1.0)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(async_engine.run)
            outputs = await collect(async_engine.generate(prepared(engine, "paused", "Hello", max_tokens=5)))
            tg.cancel_scope.cancel()
    assert paused[0].wait(5) == 0  # it woke the process
    assert outputs[-1].finish_reason == "length" and async_engine.state is not EngineState.STALLED


async def test_a_loop_held_by_work_on_it_is_not_taken_for_a_paused_process(make_engine, caplog) -> None:
    """The loop held 2.6 s by work on it (it was a first grammar's vocabulary build): the process ran all along, so
    that time was wrongly taken off every reader's and the running step's clocks as a pause."""
    engine = make_engine()
    async_engine = AsyncEngine(lambda: engine, max_pending=8)
    with caplog.at_level(logging.WARNING, logger="engine.async_engine"), anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(async_engine.run)
            await anyio.sleep(0.3)
            end = time.monotonic() + 2.6
            while time.monotonic() < end:  # work on the loop, using the CPU
                pass
            await anyio.sleep(0.5)
            tg.cancel_scope.cancel()
    assert "the event loop was held for" in caplog.text and "did not run" not in caplog.text


async def test_the_first_grammar_is_prepared_off_the_loop(make_engine, monkeypatch) -> None:
    """Its build of llguidance's vocabulary (3.6 s for Gemma 3's) held every stream and /health: here made 1 s long."""
    from engine import grammar_compiler

    real_build = grammar_compiler.build_ll_tokenizer
    monkeypatch.setattr(grammar_compiler, "build_ll_tokenizer", lambda *a: (time.sleep(1.0), real_build(*a))[1])
    engine = make_engine()
    async_engine = AsyncEngine(lambda: engine, max_pending=8)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(json_object=True))
    gaps: list[float] = []

    async def tick() -> None:
        while True:
            before = time.monotonic()
            await anyio.sleep(0.01)
            gaps.append(time.monotonic() - before)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(async_engine.run)
            tg.start_soon(tick)
            await async_engine.prepare_prompt("json", "Hello", params)
            tg.cancel_scope.cancel()
    assert engine.input_processor.grammar_compiler.has_tokenizer and max(gaps) < 0.5


@pytest.mark.parametrize(("small_after", "order"), [(0.05, ["small", "long", "wide"]), (0.6, ["long", "wide", "small"])])
async def test_a_request_whose_n_does_not_fit_yet_does_not_hold_up_the_ones_behind_it(
    make_engine, monkeypatch, small_after: float, order: list[str]
) -> None:
    """n = max_num_seqs waits for every running sequence to end; a small request behind it waited with it (21 s
    behind a long generation). Those that fit go first, for BYPASS_SECONDS (here 0.4 s); then the places free up
    for it."""
    monkeypatch.setattr("engine.async_engine.BYPASS_SECONDS", 0.4)
    engine = make_engine(max_num_seqs=4)
    slow_steps(engine, 0.01)
    async with running(engine) as async_engine:
        finished: list[str] = []

        async def run(request_id: str, **params: Any) -> None:
            outputs = await collect(async_engine.generate(prepared(engine, request_id, "Hello", **GREEDY, **params)))
            assert outputs[-1].finish_reason == "length"
            finished.append(request_id)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(run, "long", max_tokens=150))
                await anyio.sleep(0.2)
                tg.start_soon(partial(run, "wide", n=4, max_tokens=1))
                await anyio.sleep(small_after)
                tg.start_soon(partial(run, "small", max_tokens=2))
    assert finished == order


async def test_drain_returns_in_bounded_time_with_a_stuck_forward_pass(make_engine) -> None:
    engine = make_engine()
    release = threading.Event()
    real_execute = engine.execute
    engine.execute = lambda plan: (release.wait(30), real_execute(plan))[1]  # type: ignore[method-assign]
    abandoned: list[bool] = []
    async_engine = AsyncEngine(lambda: engine, max_pending=8, on_forward_abandoned=lambda: abandoned.append(True))
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(async_engine.run)
            stream = async_engine.generate(prepared(engine, "stuck", "Hello", max_tokens=5))
            await anyio.sleep(0.1)
            started = time.monotonic()
            await async_engine.drain(timeout=0.3)
            assert time.monotonic() - started < 0.3 + 2.0 + 1.0  # drain_timeout + STOP_MARGIN + slack
        assert abandoned == [True] and async_engine.is_forward_abandoned
        assert [o.finish_reason for o in await collect(stream)] == ["abort"]
    finally:
        release.set()


async def test_forward_pass_failure_fails_its_requests_and_keeps_serving(make_engine) -> None:
    engine = make_engine()
    real_execute = engine.execute
    failures = iter([RuntimeError("injected")])

    def flaky_execute(plan: Any) -> Any:
        error = next(failures, None)
        if error is not None:
            raise error
        return real_execute(plan)

    engine.execute = flaky_execute  # type: ignore[method-assign]
    async with running(engine) as async_engine:
        failed = await collect(async_engine.generate(prepared(engine, "a", "Hello world", max_tokens=5, **GREEDY)))
        assert failed[-1].finish_reason == "error" and "injected" not in (failed[-1].error or "")
        ok = await collect(async_engine.generate(prepared(engine, "b", "Hello world", max_tokens=5, **GREEDY)))
        assert ok[-1].finish_reason == "length"
        assert async_engine.state is EngineState.READY


async def test_loop_crash_ends_every_stream_with_an_error(make_engine) -> None:
    engine = make_engine()

    def broken_finish_step(plan: Any, sampled: Any) -> Any:
        raise RuntimeError("bookkeeping bug")

    engine.finish_step = broken_finish_step  # type: ignore[method-assign]
    async_engine = AsyncEngine(lambda: engine, max_pending=8)
    streams = []
    with pytest.raises(BaseException) as caught:
        async with anyio.create_task_group() as tg:
            await tg.start(async_engine.run)
            streams = [async_engine.generate(prepared(engine, f"r{i}", "Hello", max_tokens=5)) for i in range(3)]
            await anyio.sleep(5)
    assert "bookkeeping bug" in repr(caught.value)
    assert async_engine.state is EngineState.DEAD
    for stream in streams:
        outputs = await collect(stream)
        assert len(outputs) == 1 and outputs[0].finish_reason == "error" and "bookkeeping" not in outputs[0].error
    with pytest.raises(EngineUnavailable):
        async_engine.generate(prepared(engine, "late", "Hello", max_tokens=3))


async def test_n_choices_unread_merge_per_choice_and_a_drain_ends_each_one(make_engine) -> None:
    engine = make_engine(block_size=4)
    slow_steps(engine, 0.01)
    prompt = list(range(10, 40))
    async with running(engine) as async_engine:
        short = async_engine.generate(prepared(engine, "short", prompt, max_tokens=5, n=3, seed=1, **GREEDY))
        long = async_engine.generate(prepared(engine, "long", prompt, max_tokens=450, n=3, seed=1, **GREEDY))
        with anyio.fail_after(30):
            while not short.request.is_finished:
                await anyio.sleep(0.01)
        outputs = await collect(short)  # read only now: one merged delta per choice, each finished
        assert sorted(o.index for o in outputs) == [0, 1, 2]
        assert all(o.finished and o.finish_reason == "length" and len(o.new_token_ids) == 5 for o in outputs)
        await async_engine.drain(timeout=0.2)
        finals = [o for o in await collect(long) if o.finished]
        assert sorted(o.index for o in finals) == [0, 1, 2] and all(o.finish_reason == "abort" for o in finals)
    assert engine.num_free_blocks == engine.num_total_blocks


async def test_a_request_is_admitted_when_its_n_choices_fit_in_max_num_seqs(make_engine) -> None:
    engine = make_engine(max_num_seqs=4)
    slow_steps(engine, 0.01)
    async with running(engine) as async_engine:
        first = async_engine.generate(prepared(engine, "first", "Hello world", max_tokens=20, n=3, **GREEDY))
        second = async_engine.generate(prepared(engine, "second", "Hello world", max_tokens=3, n=2, **GREEDY))
        with anyio.fail_after(10):
            while first.request.admitted_time is None:
                await anyio.sleep(0.005)
        assert second.request.admitted_time is None and async_engine.stats().pending == 1  # 3 + 2 > 4: it waits
        for stream in (first, second):
            assert sum(o.finished for o in await collect(stream)) == stream.request.num_choices
        assert second.request.admitted_time is not None
    assert engine.num_free_blocks == engine.num_total_blocks


@pytest.mark.anyio
async def test_start_loading_loads_before_run_and_run_serves_that_load(make_engine) -> None:
    """A server begins the load as soon as torch is imported (web/asgi.build_host), before its event loop runs: the
    load runs once, in its own thread, and run() serves what it made; a failed load is run()'s failure, as ever."""
    loads: list[str] = []
    loaded = threading.Event()

    def load() -> LLMEngine:
        loads.append(threading.current_thread().name)
        engine = make_engine()
        loaded.set()
        return engine

    async_engine = AsyncEngine(load, max_pending=8)
    async_engine.start_loading()
    async_engine.start_loading()
    assert await anyio.to_thread.run_sync(loaded.wait, 60)  # no run() yet
    async with anyio.create_task_group() as tg:
        await tg.start(async_engine.run)
        assert async_engine.state is EngineState.READY and loads == ["sluice-start"]
        stream = async_engine.generate(prepared(async_engine._loaded_engine(), "r", "Hello", max_tokens=3))
        assert (await collect(stream))[-1].finished
        await async_engine.drain(timeout=5)

    def broken() -> LLMEngine:
        raise ValueError("the model file is truncated")

    failing = AsyncEngine(broken, max_pending=8)
    failing.start_loading()
    with pytest.raises(ValueError, match="truncated"):
        await failing.run()
    assert failing.state is EngineState.DEAD
