"""The input slot: small inputs prepared on the event loop, large ones in a worker thread, never two at once."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from engine.input_slot import InputSlot, chat_size, prompt_size

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_small_input_is_prepared_on_the_event_loop_and_a_large_one_in_a_thread() -> None:
    slot = InputSlot(max_inline_size=100)
    loop_thread = threading.get_ident()
    assert await slot.run(threading.get_ident, size=100) == loop_thread
    assert await slot.run(threading.get_ident, size=101) != loop_thread


async def test_a_small_input_waits_behind_a_large_one_and_never_runs_beside_it() -> None:
    slot = InputSlot(max_inline_size=100)
    release = threading.Event()
    running: list[str] = []
    overlaps: list[str] = []

    def job(name: str, wait: bool) -> str:
        if running:
            overlaps.append(name)
        running.append(name)
        if wait:
            release.wait(10)
        running.remove(name)
        return threading.current_thread().name

    results: dict[str, str] = {}

    async def run(name: str, size: int, wait: bool) -> None:
        results[name] = await slot.run(lambda: job(name, wait), size)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "large", 1000, True)
        with anyio.fail_after(10):
            while not running:
                await anyio.sleep(0.01)
        tg.start_soon(run, "small", 10, False)
        await anyio.sleep(0.1)
        assert "small" not in results  # the large job still holds the slot
        release.set()
    assert overlaps == []
    assert set(results) == {"large", "small"}
    assert results["small"] != threading.current_thread().name  # it went through the thread, in line


async def test_an_error_on_the_loop_frees_the_slot() -> None:
    slot = InputSlot(max_inline_size=100)

    def bad() -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        await slot.run(bad, size=1)
    assert await slot.run(lambda: 7, size=1) == 7
    assert await slot.run(lambda: 8, size=1000) == 8  # the thread's path takes the slot too


def test_sizes_follow_the_text_the_template_renders() -> None:
    assert prompt_size("héllo") == 5
    assert prompt_size([1, 2, 3]) == 3
    assert prompt_size(None) == 0
    short = [{"role": "user", "content": "hi"}]
    long = [{"role": "user", "content": "x" * 10_000}]
    assert chat_size(short, {}) < 100 < 10_000 < chat_size(long, {})
    tools = {"tools": [{"type": "function", "function": {"name": "f", "description": "d" * 5000}}]}
    assert chat_size(short, tools) > 5000
    assert chat_size("not a list", {}) == 0  # type: ignore[arg-type]


async def test_a_long_inline_job_lets_the_loop_run_others_before_the_next() -> None:
    slot = InputSlot(max_inline_size=100)
    order: list[str] = []

    def slow(name: str) -> None:
        time.sleep(0.005)  # longer than YIELD_AFTER_SECONDS
        order.append(name)

    async def other() -> None:
        order.append("other")

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)  # ready to run, behind this task
        await slot.run(lambda: slow("first"), size=1)
        await slot.run(lambda: slow("second"), size=1)
    assert order == ["first", "other", "second"]


async def test_a_quick_inline_job_keeps_the_loop() -> None:
    slot = InputSlot(max_inline_size=100)
    order: list[str] = []

    async def other() -> None:
        order.append("other")

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        await slot.run(lambda: order.append("first"), size=1)
        await slot.run(lambda: order.append("second"), size=1)
    assert order == ["first", "second", "other"]
