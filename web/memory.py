"""glibc malloc kept from hoarding: a server's resident memory at rest should come back to where it started.

Measured with `python -m bench --soak` on the default model: glibc gives each thread that contends for the
heap an arena of its own (up to 8 per core), and freed memory stays in them. The forward pass, the input
processor and Hypercorn's threads took about eight 64 MiB arenas, and the server's RSS at rest rose by
380 MiB in two minutes of mixed load; `malloc_trim(0)` at that point gave 270 MiB back. So: two arenas,
and a trim whenever the engine has been idle for a while. Elsewhere than glibc both are no-ops.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import anyio

from engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

M_ARENA_MAX = -8  # mallopt parameter number, glibc's malloc.h
NUM_ARENAS = 2
IDLE_TRIM_SECONDS = 10.0  # idle this long after work: the freed memory is handed back
LOOK_SECONDS = 1.0


def _glibc() -> Any | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def limit_arenas() -> None:
    """Call before the worker threads start: arenas already made stay."""
    libc = _glibc()
    if libc is not None and not libc.mallopt(M_ARENA_MAX, NUM_ARENAS):
        logger.warning("mallopt(M_ARENA_MAX) failed; resident memory may grow with threads")


def _is_idle(engine: AsyncEngine) -> bool:
    stats = engine.stats()
    return stats.state == "ready" and not (stats.running or stats.waiting or stats.pending)


async def trim_while_idle(engine: AsyncEngine, idle_seconds: float = IDLE_TRIM_SECONDS) -> None:
    """Runs until cancelled: once the engine, busy before, has been idle for `idle_seconds`, returns the
    heap's free pages to the system (in a worker thread: a trim walks every arena)."""
    libc = _glibc()
    if libc is None:
        return
    idle_for: float | None = None  # None: nothing to give back since the last trim
    while True:
        await anyio.sleep(LOOK_SECONDS)
        if not _is_idle(engine):
            idle_for = 0.0
        elif idle_for is not None:
            idle_for += LOOK_SECONDS
            if idle_for >= idle_seconds:
                idle_for = None
                await anyio.to_thread.run_sync(libc.malloc_trim, 0)
