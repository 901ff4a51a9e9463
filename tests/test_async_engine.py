"""AsyncEngine on the real engine with the tiny model: admission, delivery, abort, drain, failures."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from engine.async_engine import AsyncEngine, EngineState, EngineUnavailable, QueueFull, RequestStream
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from server_harness import tiny_engine_config

pytestmark = pytest.mark.anyio
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def make_engine(tiny_llama_dir) -> Callable[..., LLMEngine]:
    return lambda **overrides: LLMEngine(tiny_engine_config(tiny_llama_dir, **overrides))


@asynccontextmanager
async def running(engine: LLMEngine, max_pending: int = 8) -> AsyncIterator[AsyncEngine]:
    async_engine = AsyncEngine(lambda: engine, max_pending=max_pending)
    async with anyio.create_task_group() as tg:
        await tg.start(async_engine.run)
        yield async_engine
        await async_engine.drain(timeout=5)


async def collect(stream: RequestStream) -> list[RequestOutput]:
    return [output async for output in stream]


def offline_text(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> str:
    engine.add_request("offline", prompt, params)
    text = ""
    while engine.has_unfinished_requests:
        text += "".join(o.text_delta for o in engine.step())
    return text


async def test_results_match_the_offline_engine_and_end_once(make_engine) -> None:
    engine = make_engine()
    prompts = [engine.encode_prompt(p) for p in ("Hello world", "The quick brown fox", "Paged attention")]
    params = SamplingParams(max_tokens=12, **GREEDY)
    expected = [offline_text(engine, p, params) for p in prompts]
    async with running(engine) as async_engine:
        streams = [async_engine.submit(f"r{i}", p, params) for i, p in enumerate(prompts)]
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


async def test_queue_full_when_the_scheduler_has_no_room(make_engine) -> None:
    engine = make_engine(max_num_seqs=1, max_num_batched_tokens=64)
    prompt = engine.encode_prompt("Hello world")
    async with running(engine, max_pending=2) as async_engine:
        blocker = async_engine.submit("blocker", prompt, SamplingParams(max_tokens=200, **GREEDY))
        await anyio.sleep(0.05)  # the loop takes it: the scheduler is now full
        queued = [async_engine.submit(f"q{i}", prompt, SamplingParams(max_tokens=2, **GREEDY)) for i in range(2)]
        with pytest.raises(QueueFull):
            async_engine.submit("rejected", prompt, SamplingParams(max_tokens=2))
        assert async_engine.num_pending == 2
        for stream in (blocker, *queued):
            assert (await collect(stream))[-1].finish_reason == "length"


async def test_abort_while_queued_and_while_running(make_engine) -> None:
    engine = make_engine(max_num_seqs=1, max_num_batched_tokens=64)
    prompt = engine.encode_prompt("Hello world")
    async with running(engine) as async_engine:
        running_stream = async_engine.submit("running", prompt, SamplingParams(max_tokens=400, **GREEDY))
        queued = async_engine.submit("queued", prompt, SamplingParams(max_tokens=4, **GREEDY))
        await anyio.sleep(0.05)
        assert async_engine.abort("queued") and not async_engine.abort("queued")
        assert (await collect(queued))[-1].finish_reason == "abort"
        first = await running_stream.__anext__()
        assert not first.finished
        assert async_engine.abort("running")
        rest = await collect(running_stream)
        assert rest[-1].finish_reason == "abort" and [o.finished for o in rest].count(True) == 1
        after = async_engine.submit("after", prompt, SamplingParams(max_tokens=3, **GREEDY))
        assert (await collect(after))[-1].finish_reason == "length"
        assert engine.num_free_blocks == engine.num_total_blocks


async def test_closed_reader_is_aborted(make_engine) -> None:
    engine = make_engine()
    prompt = engine.encode_prompt("Hello world")
    async with running(engine) as async_engine:
        stream = async_engine.submit("gone", prompt, SamplingParams(max_tokens=400, **GREEDY))
        await stream.__anext__()
        stream.close()
        with anyio.fail_after(5):
            while engine.has_unfinished_requests:
                await anyio.sleep(0.01)
        assert engine.num_free_blocks == engine.num_total_blocks


async def test_drain_finishes_in_flight_then_aborts_the_rest(make_engine) -> None:
    engine = make_engine()
    prompt = engine.encode_prompt("Hello world")
    async_engine = AsyncEngine(lambda: engine, max_pending=8)
    async with anyio.create_task_group() as tg:
        await tg.start(async_engine.run)
        short = async_engine.submit("short", prompt, SamplingParams(max_tokens=3, **GREEDY))
        long = async_engine.submit("long", prompt, SamplingParams(max_tokens=450, **GREEDY))
        results: dict[str, list[RequestOutput]] = {}

        async def read(name: str, stream: RequestStream) -> None:
            results[name] = await collect(stream)

        tg.start_soon(read, "short", short)
        tg.start_soon(read, "long", long)
        await async_engine.drain(timeout=0.3)
        with pytest.raises(EngineUnavailable):
            async_engine.submit("late", prompt, SamplingParams(max_tokens=3))
    assert results["short"][-1].finish_reason == "length"
    assert results["long"][-1].finish_reason == "abort"
    assert async_engine.state is EngineState.STOPPED
    assert engine.num_free_blocks == engine.num_total_blocks


async def test_forward_pass_failure_fails_its_requests_and_keeps_serving(make_engine) -> None:
    engine = make_engine()
    prompt = engine.encode_prompt("Hello world")
    real_execute = engine.execute
    failures = iter([RuntimeError("injected")])

    def flaky_execute(plan: Any) -> Any:
        error = next(failures, None)
        if error is not None:
            raise error
        return real_execute(plan)

    engine.execute = flaky_execute  # type: ignore[method-assign]
    async with running(engine) as async_engine:
        failed = await collect(async_engine.submit("a", prompt, SamplingParams(max_tokens=5, **GREEDY)))
        assert failed[-1].finish_reason == "error" and "injected" in (failed[-1].error or "")
        ok = await collect(async_engine.submit("b", prompt, SamplingParams(max_tokens=5, **GREEDY)))
        assert ok[-1].finish_reason == "length"
        assert async_engine.state is EngineState.READY


async def test_loop_crash_ends_every_stream_with_an_error(make_engine) -> None:
    engine = make_engine()
    prompt = engine.encode_prompt("Hello world")

    def broken_finish_step(plan: Any, sampled: Any) -> Any:
        raise RuntimeError("bookkeeping bug")

    engine.finish_step = broken_finish_step  # type: ignore[method-assign]
    async_engine = AsyncEngine(lambda: engine, max_pending=8)
    streams = []
    with pytest.raises(BaseException) as caught:
        async with anyio.create_task_group() as tg:
            await tg.start(async_engine.run)
            streams = [async_engine.submit(f"r{i}", prompt, SamplingParams(max_tokens=5)) for i in range(3)]
            await anyio.sleep(5)
    assert "bookkeeping bug" in repr(caught.value)
    assert async_engine.state is EngineState.DEAD
    for stream in streams:
        outputs = await collect(stream)
        assert len(outputs) == 1 and outputs[0].finish_reason == "error"
    with pytest.raises(EngineUnavailable):
        async_engine.submit("late", prompt, SamplingParams(max_tokens=3))


async def test_too_long_requests_are_rejected_before_queueing(make_engine) -> None:
    engine = make_engine()
    async with running(engine) as async_engine:
        with pytest.raises(ValueError, match=r"500.*512|512.*500"):
            async_engine.submit("long", [5] * 500, SamplingParams(max_tokens=100))
        assert async_engine.num_pending == 0
