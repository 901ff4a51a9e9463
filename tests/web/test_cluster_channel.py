"""A replica's channel to one front (web/cluster/replica.py's FrontChannel): the deltas that are ready together
leave as one item, an abort closes the request's stream at once, a second reader of the same front takes over
from the first without losing or aborting anything, and requests no reader comes for are aborted; and how the
replica queues a batch of requests (submit_many)."""

from __future__ import annotations

import asyncio
import warnings
from types import SimpleNamespace

import pytest

from engine.async_engine import EngineState, EngineUnavailable, QueueFull
from engine.input_processor import PreparedRequest
from web.cluster.submit_batches import Refusal

pytest.importorskip("ray", reason="the cluster extra (pip install -e '.[cluster]') is not installed")
with warnings.catch_warnings():  # Ray Serve's import warns about its own use of pydantic's deprecated Field
    warnings.simplefilter("ignore", DeprecationWarning)
    from web.cluster.replica import EngineReplica, FrontChannel, FrontChannels


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


def test_a_batch_queues_its_plain_requests_before_compiling_a_grammar_and_refuses_requests_alone() -> None:
    """EngineReplica.submit_many: a request with a grammar is compiled after the others are queued (the first
    compilation can take seconds); a request refused (full) or failing is refused alone; an engine that takes
    nothing (stopping) fails the whole call, so that the front sends the batch elsewhere."""
    events: list[str] = []

    class Engine:
        is_stopping = False

        def generate(self, request: PreparedRequest) -> FakeStream:
            if self.is_stopping:
                raise EngineUnavailable(EngineState.DRAINING)
            if request.request_id == "full":
                raise QueueFull("no room")
            events.append(f"queued {request.request_id}")
            return FakeStream(request.request_id)

    def compile_grammar(structured: str, phase: object) -> str:
        if structured == "bad":
            raise ValueError("no grammar")
        events.append(f"compiled {structured}")
        return "a matcher"

    class Bare(EngineReplica.func_or_class):  # type: ignore[name-defined]  # its face without Ray and a model
        def __del__(self) -> None:
            pass  # there is no engine loop to cancel

    replica = object.__new__(Bare)
    replica.index, replica.engine, replica._fronts = 0, Engine(), FrontChannels()
    processor = SimpleNamespace(compile_grammar=compile_grammar, grammar_compiler=SimpleNamespace(has_tokenizer=True))
    replica._loaded = [SimpleNamespace(input_processor=processor)]

    def request(request_id: str, structured: str | None = None) -> PreparedRequest:
        params = SimpleNamespace(structured_outputs=structured)
        return PreparedRequest(request_id, [1], params, 4)  # type: ignore[arg-type]

    async def scenario() -> dict[str, Refusal]:
        batch = [request("g", "json"), request("a"), request("full"), request("bad", "bad"), request("b")]
        refusals = await replica.submit_many("front", batch)
        replica.engine.is_stopping = True
        with pytest.raises(EngineUnavailable):
            await replica.submit_many("front", [request("c")])
        replica._fronts.end_reader("front", replica._fronts.for_reader("front")[1])
        return refusals

    refusals = asyncio.run(scenario())
    assert events == ["queued a", "queued b", "compiled json", "queued g"]
    assert refusals == {"full": Refusal(is_full=True, message="no room"),
                        "bad": Refusal(is_full=False, message="ValueError: no grammar")}  # fmt: skip
