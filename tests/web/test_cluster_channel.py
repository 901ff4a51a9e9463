"""A replica's channel to one front (web/cluster/replica.py's FrontChannel): the deltas that are ready together
leave as one item, an abort closes the request's stream at once, a second reader of the same front takes over
from the first without losing or aborting anything, and requests no reader comes for are aborted."""

from __future__ import annotations

import asyncio
import warnings

import pytest

pytest.importorskip("ray", reason="the cluster extra (pip install -e '.[cluster]') is not installed")
with warnings.catch_warnings():  # Ray Serve's import warns about its own use of pydantic's deprecated Field
    warnings.simplefilter("ignore", DeprecationWarning)
    from web.cluster.replica import FrontChannel, FrontChannels


class FakeStream:
    """An OutputStream's face: its deltas come from a queue; closing it ends the iteration."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.num_closes = 0

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> str:
        item = await self.queue.get()
        if item is None or self.num_closes:
            raise StopAsyncIteration
        return item

    def close(self) -> None:
        self.num_closes += 1
        self.queue.put_nowait(None)


def test_deltas_ready_together_leave_as_one_item_and_an_abort_closes_at_once() -> None:
    async def scenario() -> None:
        channel = FrontChannel()
        reader = channel.take_over()
        a, b = FakeStream("a"), FakeStream("b")
        channel.add(a)  # type: ignore[arg-type]
        channel.add(b)  # type: ignore[arg-type]
        a.queue.put_nowait("a1")
        b.queue.put_nowait("b1")
        assert await asyncio.wait_for(channel.next_batch(reader), 5) == [("a", "a1"), ("b", "b1")]
        channel.abort("b")
        assert b.num_closes >= 1  # before its task runs again
        a.queue.put_nowait(None)  # a finishes
        await asyncio.sleep(0.01)
        channel.close()  # nothing left to abort
        assert a.num_closes == 1

    asyncio.run(scenario())


def test_a_second_reader_takes_over_and_the_first_gets_nothing() -> None:
    async def scenario() -> None:
        channel = FrontChannel()
        first = channel.take_over()
        waiting = asyncio.create_task(channel.next_batch(first))
        await asyncio.sleep(0.01)
        second = channel.take_over()
        assert await asyncio.wait_for(waiting, 5) is None  # superseded: it ends without taking anything
        stream = FakeStream("a")
        channel.add(stream)  # type: ignore[arg-type]
        stream.queue.put_nowait("a1")
        assert await asyncio.wait_for(channel.next_batch(second), 5) == [("a", "a1")]
        assert channel.reader is second and stream.num_closes == 0
        channel.close()

    asyncio.run(scenario())


def test_requests_no_reader_comes_for_are_aborted_and_a_late_reader_keeps_them() -> None:
    async def scenario() -> None:
        fronts = FrontChannels(unread_seconds=0.05)
        orphan = FakeStream("a")
        fronts.for_submit("dead-front").add(orphan)  # type: ignore[arg-type]
        kept = FakeStream("b")
        fronts.for_submit("slow-front").add(kept)  # type: ignore[arg-type]
        channel, reader = fronts.for_reader("slow-front")  # its stream opens after the submit landed
        await asyncio.sleep(0.2)
        assert orphan.num_closes >= 1 and fronts.get("dead-front") is None
        assert kept.num_closes == 0 and fronts.get("slow-front") is channel
        kept.queue.put_nowait("b1")
        assert await asyncio.wait_for(channel.next_batch(reader), 5) == [("b", "b1")]
        fronts.end_reader("slow-front", object())  # a superseded call's end changes nothing
        assert fronts.get("slow-front") is channel and kept.num_closes == 0
        fronts.end_reader("slow-front", reader)  # the front's stream ended: what it had here is aborted
        assert kept.num_closes >= 1 and fronts.get("slow-front") is None

    asyncio.run(scenario())
