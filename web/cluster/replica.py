"""One engine replica: an AsyncEngine (its own KV pool and prefix cache) inside a Ray Serve deployment.

The front sends it prepared requests (tokenized and checked there) with submit_many() and reads the deltas of all of
them back through one streaming call per front, outputs(): each item is every delta that was ready, typically
one step's deltas of every request, so a step of 64 streams costs one Ray item, not 64. abort() (the client
left, or the front drains) closes a request's output stream: the engine frees it before its next step. A front
whose outputs() call ends (cancelled, or the front died) has every request it sent here aborted.
A failed engine loop or a stalled step ends the process (exit code 1), as a single server would exit, and Ray
Serve starts a replacement; check_health() reports the same state to Ray Serve's health checks.

Imported only in Ray's worker processes and by the front's launcher, never without --replicas.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from ray import serve

from engine.async_engine import AsyncEngine, EngineState, EngineUnavailable, QueueFull
from engine.config import SluiceConfig
from engine.errors import load_refusals
from engine.input_processor import PreparedRequest
from engine.outputs import RequestOutput
from engine.request import OutputStream
from engine.speculative.stats import summed_counts
from web.cluster.stats import ReplicaStats
from web.cluster.submit_batches import Refusal

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

logger = logging.getLogger("sluice.replica")
FAILURE_FLUSH_SECONDS = 0.5  # the ended streams' last deltas reach the front before the process exits
# A front's requests that no outputs() call reads (the front died between its submit and opening, or re-opening,
# its stream) are aborted after this; a living front re-opens its stream within its poll of a few seconds.
UNREAD_CHANNEL_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class ReplicaFacts:
    """What the front needs to prepare requests for this model: the tokenizer travels with it, so the front
    needs no copy of the model's files."""

    model_name: str
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    max_num_seqs: int
    block_size: int
    num_kv_blocks: int


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=100_000,  # the front bounds admission (max_num_seqs + max_pending a replica)
    # A hung process (no answer at all: the in-process watchdog cannot run) is replaced after Ray Serve's 3
    # missed checks: about 3 x 10 s.
    health_check_period_s=2.0,
    health_check_timeout_s=10.0,
    graceful_shutdown_timeout_s=5.0,
    # A replica that cannot load (a file or setting refused) fails the same way each time: the start fails with its
    # reason after a few tries, not Serve's default 20 (minutes of restarts behind a front answering 503).
    max_constructor_retry_count=2,
    logging_config={"enable_access_log": False, "log_level": "WARNING"},  # no line per call of every stream
)
class EngineReplica:
    async def __init__(self, config: SluiceConfig, index: int) -> None:  # type: ignore[misc]
        # Before any compute thread exists (Linux niceness is per thread; new threads inherit it): the engine's
        # forward passes yield to a front that shares these CPUs.
        os.nice(config.cluster.replica_nice)
        from engine.kv_pool import share_memory
        from engine.llm_engine import LLMEngine  # torch: in the replica's process only

        if not config.cluster.ray_address:  # a local Ray: every replica's KV pool on this machine
            share_memory(config.cluster.replicas)

        logging.basicConfig(level=config.server.log_level.upper())
        self.index = index
        self.config = config
        self._loaded: list[LLMEngine] = []
        self._fronts = FrontChannels()

        def load() -> LLMEngine:
            self._loaded.append(LLMEngine(config.engine))
            return self._loaded[-1]

        server = config.server
        self.engine = AsyncEngine(
            load,
            # The front bounds what it sends here to max_num_seqs running + max_pending queued; a burst may
            # arrive between two steps, before the loop moves any of it to the scheduler, so this queue holds both.
            max_pending=server.max_pending + config.engine.max_num_seqs,
            step_timeout=server.step_timeout,
            client_read_timeout=server.client_read_timeout,
            on_forward_abandoned=partial(self._exit_soon, 2.0),
        )
        self._started = asyncio.Event()
        self._load_error: BaseException | None = None
        self._loop_task = asyncio.get_running_loop().create_task(self._run())
        await self._started.wait()  # Ray Serve counts the replica ready once its model is loaded and warm
        if self._load_error is not None:  # a constructor that fails: Serve tries max_constructor_retry_count times
            raise self._load_error

    async def _run(self) -> None:
        def started(_: object = None) -> None:
            self._started.set()

        status = _Started(started)
        try:
            await self.engine.run(task_status=status)
        except asyncio.CancelledError:
            raise  # the replica is being shut down
        except BaseException as error:
            if not self._started.is_set():  # the model did not load: the constructor says why
                reasons = load_refusals(error)
                self._load_error = ValueError("; ".join(reasons)) if reasons else error
                self._started.set()
                return
            logger.exception("replica %d: the engine loop ended", self.index)
        if self.engine.state in (EngineState.DEAD, EngineState.STALLED) or not self._started.is_set():
            await asyncio.sleep(FAILURE_FLUSH_SECONDS)
            self._exit_soon(0.0)

    def _exit_soon(self, delay: float) -> None:
        """The engine cannot serve again: end the process, and Ray Serve replaces it."""
        asyncio.get_running_loop().call_later(delay, os._exit, 1)

    @property
    def _llm(self) -> LLMEngine:
        return self._loaded[-1]

    async def facts(self) -> ReplicaFacts:
        llm = self._llm
        return ReplicaFacts(
            model_name=llm.model_name,
            tokenizer=llm.tokenizer,
            vocab_size=llm.vocab_size,
            max_model_len=llm.max_model_len,
            eos_token_ids=llm.eos_token_ids,
            max_num_seqs=llm.config.max_num_seqs,
            block_size=llm.config.block_size,
            num_kv_blocks=llm.config.num_kv_blocks,
        )

    async def stats(self) -> ReplicaStats:
        stats = self.engine.stats()
        blocks = self._llm.block_manager
        return ReplicaStats(
            pid=os.getpid(),
            state=stats.state,
            running=stats.running,
            waiting=stats.waiting,
            pending=stats.pending,
            free_kv_blocks=stats.free_kv_blocks,
            total_kv_blocks=stats.total_kv_blocks,
            num_prefix_queries=blocks.num_prefix_queries,
            num_prefix_hits=blocks.num_prefix_hits,
            num_preemptions=stats.num_preemptions,
            speculation=summed_counts(stats.speculation or {}),  # a copy: the engine's own go on counting
        )

    async def submit_many(self, front_id: str, requests: list[PreparedRequest]) -> dict[str, Refusal]:
        """Queue the requests (their deltas go out on that front's outputs()); a Refusal, by request id, for each one
        not queued: full (QueueFull) or its own failure. Those with a grammar are queued after the others: the first
        compilation waits for llguidance's view of the vocabulary (seconds for a large one)."""
        refusals: dict[str, Refusal] = {}
        for request in sorted(requests, key=lambda r: r.params.structured_outputs is not None):  # stable: in order
            try:
                if request.params.structured_outputs is not None:
                    request = await self._with_matcher(request)
                self._fronts.for_submit(front_id).add(self.engine.generate(request))
            except QueueFull as full:  # only when other fronts share this replica and filled it meanwhile
                refusals[request.request_id] = Refusal(is_full=True, message=str(full))
            except EngineUnavailable:
                raise  # the replica takes nothing now (it is stopping): the front sends the whole batch elsewhere
            except Exception as error:
                logger.exception("replica %d: request %s not queued", self.index, request.request_id)
                refusals[request.request_id] = Refusal(is_full=False, message=f"{type(error).__name__}: {error}")
        return refusals

    async def _with_matcher(self, request: PreparedRequest) -> PreparedRequest:
        """A grammar matcher does not travel: compile it here, after the thought, as one process compiles it (the
        front read where the output starts)."""
        assert request.params.structured_outputs is not None
        processor = self._llm.input_processor
        compile_it = partial(processor.compile_grammar, request.params.structured_outputs, request.first_phase)
        # the first also builds llguidance's view of the vocabulary (seconds for a large one): not on the loop
        matcher = compile_it() if processor.grammar_compiler.has_tokenizer else await asyncio.to_thread(compile_it)
        return replace(request, matcher=matcher)

    async def abort(self, front_id: str, request_id: str) -> None:
        channel = self._fronts.get(front_id)
        if channel is not None:
            channel.abort(request_id)

    async def outputs(self, front_id: str) -> AsyncIterator[list[tuple[str, RequestOutput]]]:
        """Every delta of the front's requests as (request id, delta), in lists of what was ready together. Its
        end (the front cancels it, or is gone) aborts every request the front has here."""
        channel, reader = self._fronts.for_reader(front_id)
        try:
            while (batch := await channel.next_batch(reader)) is not None:
                yield batch
        finally:
            self._fronts.end_reader(front_id, reader)

    async def drain(self, timeout: float) -> None:
        await self.engine.drain(timeout)

    def check_health(self) -> None:
        state = self.engine.state
        if state in (EngineState.DEAD, EngineState.STALLED):
            raise RuntimeError(f"replica {self.index}: the engine is {state.value}")

    async def __del__(self) -> None:
        self._loop_task.cancel()


class FrontChannels:
    """The channels of the fronts that send requests here, by front id."""

    def __init__(self, unread_seconds: float = UNREAD_CHANNEL_SECONDS) -> None:
        self.unread_seconds = unread_seconds
        self._channels: dict[str, FrontChannel] = {}

    def get(self, front_id: str) -> FrontChannel | None:
        return self._channels.get(front_id)

    def for_submit(self, front_id: str) -> FrontChannel:
        channel = self._channels.get(front_id)
        if channel is None:
            channel = self._channels[front_id] = FrontChannel()
            asyncio.get_running_loop().call_later(self.unread_seconds, self._close_if_unread, front_id, channel)
        return channel

    def for_reader(self, front_id: str) -> tuple[FrontChannel, object]:
        """The channel and a new reader token: a front that lost its stream and opened another takes over, and
        the old call ends."""
        channel = self._channels.setdefault(front_id, FrontChannel())
        return channel, channel.take_over()

    def end_reader(self, front_id: str, reader: object) -> None:
        """The front's outputs() call ended (cancelled, or the front is gone): unless a newer call took over,
        every request the front has here is aborted."""
        channel = self._channels.get(front_id)
        if channel is not None and channel.reader is reader:
            del self._channels[front_id]
            channel.close()

    def _close_if_unread(self, front_id: str, channel: FrontChannel) -> None:
        if channel.reader is None and self._channels.get(front_id) is channel:
            logger.warning("front %s opened no output stream in %.0f s: its %d requests here are aborted",
                           front_id, self.unread_seconds, channel.num_requests)  # fmt: skip
            del self._channels[front_id]
            channel.close()


class FrontChannel:
    """One front's requests on this replica: each request's task moves its deltas into one list, which the front's
    current outputs() call (its `reader`) takes whole."""

    def __init__(self) -> None:
        self._streams: dict[str, tuple[OutputStream, asyncio.Task[None]]] = {}
        self._ready: list[tuple[str, RequestOutput]] = []
        self._wakeup = asyncio.Event()
        self.reader: object | None = None

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    def take_over(self) -> object:
        self.reader = object()
        self._wakeup.set()  # a superseded call waiting in next_batch() wakes up and ends
        return self.reader

    def add(self, outputs: OutputStream) -> None:
        reader = asyncio.get_running_loop().create_task(self._read(outputs))
        self._streams[outputs.request_id] = (outputs, reader)

    async def _read(self, outputs: OutputStream) -> None:
        try:
            async for output in outputs:
                self._ready.append((outputs.request_id, output))
                self._wakeup.set()
        finally:
            outputs.close()  # an unfinished request (its reader cancelled) is aborted in the engine
            self._streams.pop(outputs.request_id, None)

    async def next_batch(self, reader: object) -> list[tuple[str, RequestOutput]] | None:
        """The deltas ready now (waiting for one); None once another reader has taken over."""
        while self.reader is reader and not self._ready:
            await self._wakeup.wait()
            self._wakeup.clear()
        if self.reader is not reader:
            return None
        batch, self._ready = self._ready, []
        return batch

    def abort(self, request_id: str) -> None:
        entry = self._streams.pop(request_id, None)
        if entry is not None:
            outputs, reader = entry
            outputs.close()  # at once, even if its reader has not started
            reader.cancel()

    def close(self) -> None:
        for request_id in list(self._streams):
            self.abort(request_id)


class _Started:
    """anyio's task_status for a loop started outside a task group."""

    def __init__(self, callback: Any) -> None:
        self.started = callback

