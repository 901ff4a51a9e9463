"""Submits in batches: the requests the front routes to one replica within one lap of its event loop leave in one
Ray call (EngineReplica.submit_many), and the replica answers for each request it did not queue (a Refusal).

Why: each Ray call wakes Ray Serve's router thread (`call_soon_threadsafe`) and costs the front's loop and the
GIL for every request; a wave of 64 requests arriving together is prepared in one or two laps, so it costs one
call a replica rather than 64. A lap adds no wait: the batch leaves in the next lap, once the loop has run what
was ready with the first request, which is when each request's own task used to send it.
No Ray here: the front imports this without Ray.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from anyio.abc import TaskGroup

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a replica did not queue one request of a batch: full (QueueFull: other fronts filled it), or a failure
    of that request alone (message). The rest of the batch is queued."""

    is_full: bool
    message: str


class LapBatches(Generic[K, T]):
    """Items grouped by key until the task that sends them runs: it is started by the first item of a key and
    runs once the loop has run everything that was ready with it."""

    def __init__(self, send: Callable[[K, list[T]], Awaitable[None]]) -> None:
        self._send = send
        self._pending: dict[K, list[T]] = {}

    def add(self, tg: TaskGroup, key: K, item: T) -> None:
        batch = self._pending.get(key)
        if batch is None:
            batch = self._pending[key] = []
            tg.start_soon(self._flush, key)
        batch.append(item)

    async def _flush(self, key: K) -> None:
        await self._send(key, self._pending.pop(key))
