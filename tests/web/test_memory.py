"""The idle trim: glibc's free pages go back to the system once the engine, busy before, has rested."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import anyio
import pytest

from web import memory


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class FakeStats:
    state: str = "ready"
    running: int = 0
    waiting: int = 0
    pending: int = 0


class FakeEngine:
    def __init__(self) -> None:
        self.current = FakeStats()

    def stats(self) -> FakeStats:
        return self.current


class CountingLibc:
    def __init__(self) -> None:
        self.num_trims = 0

    def malloc_trim(self, pad: int) -> int:
        self.num_trims += 1
        return 1


@pytest.mark.anyio
async def test_trims_once_after_work_then_rests(monkeypatch) -> None:
    libc = CountingLibc()
    monkeypatch.setattr(memory, "_glibc", lambda: libc)
    monkeypatch.setattr(memory, "LOOK_SECONDS", 0.01)
    engine = FakeEngine()
    async with anyio.create_task_group() as tg:
        tg.start_soon(memory.trim_while_idle, engine, 0.05)
        await anyio.sleep(0.2)
        assert libc.num_trims == 0  # idle from the start: nothing was freed
        engine.current = FakeStats(running=1)
        await anyio.sleep(0.2)
        assert libc.num_trims == 0  # busy: never trimmed under load
        engine.current = FakeStats()
        await anyio.sleep(0.3)
        assert libc.num_trims == 1  # one trim after the rest, not one per look
        tg.cancel_scope.cancel()


def test_limit_arenas_sets_the_real_glibc_option() -> None:
    memory.limit_arenas()  # must not raise, here or on a libc without mallopt
    libc = memory._glibc()
    if libc is not None:
        assert libc.mallopt(memory.M_ARENA_MAX, memory.NUM_ARENAS) == 1
        assert isinstance(libc.malloc_trim(ctypes.c_size_t(0)), int)
