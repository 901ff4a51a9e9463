"""Continuous batching with a per-step token budget, chunked prefill and preemption by recompute.

Each step serves the running sequences first (in arrival order: a decode costs one token, an unfinished
prefill continues with the next chunk), then admits waiting ones in FCFS order while the budget, max_num_seqs
(a fork parent takes the seats of its n choices) and free blocks allow. When a running sequence needs a block
and none is free, the most recently admitted running sequence is preempted: its blocks are freed (a block
shared with other choices stays theirs) and it goes back to the front of the queue, to be recomputed (through
the prefix cache, mostly) later. The scheduler never touches tensors.

With a speculator, a decoding sequence may also feed draft tokens (engine/speculative/): its chunk is then its
last token and k drafts, offered once every running sequence has its chunk, from the budget and the free
blocks left (so drafts never cause a preemption nor crowd a running sequence out). After the step only
the accepted drafts count as computed, and blocks that hold nothing but rejected drafts go back to the pool.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sequence import Sequence, SequenceStatus
from engine.speculative.speculator import Speculator


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens fed this step, from seq.num_computed_tokens on (drafts included)
    draft_token_ids: list[int] = field(default_factory=list)  # guessed tokens fed after the last one
    num_accepted: int = 0  # of the drafts, set by the engine once the step has verified them

    @property
    def is_sampling(self) -> bool:
        """The chunk reaches the last token, so the step yields the sequence's next token (a fork parent's never)."""
        num_fed = self.num_tokens - len(self.draft_token_ids)
        return self.seq.num_computed_tokens + num_fed == self.seq.num_tokens and not self.seq.num_forks


class Scheduler:
    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, speculator: Speculator | None = None
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.speculator = speculator if speculator is not None and speculator.is_enabled else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledChunk] = []
        has_preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_tokens):
                has_preempted = True
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledChunk(seq, num_tokens))
                budget -= num_tokens
                i += 1
        if has_preempted:
            return scheduled  # no drafts nor admissions while memory is short: they would be preempted next
        if self.speculator is not None:
            budget = self._add_drafts(scheduled, budget)
        num_seats = sum(seq.num_seats for seq in self.running)
        while self.waiting and budget > 0 and num_seats + self.waiting[0].num_seats <= self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq, budget):
                break
            self.waiting.popleft()
            num_seats += seq.num_seats
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            scheduled.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens
        return scheduled

    def _add_drafts(self, scheduled: list[ScheduledChunk], budget: int) -> int:
        """Once every running sequence has its chunk, give decoding ones drafts from the budget and the blocks
        left (so drafts never take a block a running sequence needs: they never cause a preemption); returns
        the budget left."""
        num_running = len(self.running)
        for chunk in scheduled:
            if budget <= 0:
                break
            seq = chunk.seq
            if seq.num_uncomputed_tokens != 1:
                continue
            # >= 0: the decode's own slot is allocated; no room, no proposal (it costs Python per sequence)
            room = min(budget, self.block_manager.num_fitting_tokens(seq) - 1)
            drafts = self.speculator.propose(seq, num_running)[:room] if room else []
            if drafts and self.block_manager.allocate_slots(seq, 1 + len(drafts)):
                chunk.num_tokens += len(drafts)
                chunk.draft_token_ids = drafts
                budget -= len(drafts)
        return budget

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Give a waiting sequence its cached prefix and blocks for its first chunk; False if they are short."""
        # A request that scores its prompt needs every prompt position computed: no cached prefix for it.
        num_cached = 0 if seq.prompt_logprobs is not None else self.block_manager.allocate_cached_prefix(seq)
        num_tokens = min(seq.num_uncomputed_tokens, budget)
        if not self.block_manager.allocate_slots(seq, num_tokens):
            self.block_manager.free(seq)
            return False
        if seq.is_first_admission:
            seq.is_first_admission = False
            seq.num_cached_tokens = num_cached
            # One lookup of the request's whole prompt, whatever its n: a fork parent's prompt is only the shared
            # blocks, and the n choices of a one-block prompt are each admitted (choice 0 first).
            if seq.index == 0:
                self.block_manager.record_prefix_query(len(seq.request.prompt_token_ids), num_cached)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def on_computed(self, chunks: list[ScheduledChunk]) -> None:
        """After a forward pass: advance KV progress and offer newly filled blocks to the prefix cache. A
        verification chunk advances past its accepted drafts only: the KV of the rejected ones is garbage to be
        overwritten, and the blocks holding only that go back to the pool."""
        for chunk in chunks:
            seq = chunk.seq
            if chunk.draft_token_ids:
                seq.num_computed_tokens += chunk.num_tokens - len(chunk.draft_token_ids) + chunk.num_accepted
                self.block_manager.trim(seq)
            else:
                seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.cache_full_blocks(seq)

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """A fork parent has computed its prefix: its children take its blocks by reference count and its
        place in the running batch (the seats it held), and the parent ends."""
        assert parent.status is SequenceStatus.RUNNING and not parent.num_uncomputed_tokens, parent
        for child in children:
            self.block_manager.share(parent, child)
            child.status = SequenceStatus.RUNNING
            child.is_first_admission = False
            child.num_cached_tokens = parent.num_cached_tokens
        i = self.running.index(parent)
        self.running[i : i + 1] = children
        self.block_manager.free(parent)
        parent.status = SequenceStatus.FINISHED

    def finish(self, seq: Sequence) -> None:
        """End a sequence wherever it is (waiting, prefilling, decoding) and free its blocks. Idempotent."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
