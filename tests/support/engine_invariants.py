"""The engine's bookkeeping invariants, checked between steps: every KV block's reference count is its number of
holders, the free list is exactly the unreferenced blocks, the prefix cache names blocks that hold what it says,
waiting and finished sequences hold nothing, and the engine's requests are the scheduler's sequences."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from engine.llm_engine import LLMEngine
from engine.sequence import Sequence, SequenceStatus


def assert_engine_consistent(engine: LLMEngine, finished: Iterable[Sequence] = ()) -> None:
    manager, scheduler = engine.block_manager, engine.scheduler
    block_size = manager.block_size
    holders: Counter[int] = Counter()
    for seq in scheduler.waiting:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table and not seq.num_computed_tokens, seq
    for seq in scheduler.running:
        assert seq.status is SequenceStatus.RUNNING, seq
        assert len(set(seq.block_table)) == len(seq.block_table), seq
        assert seq.num_computed_tokens <= seq.num_tokens, seq
        # between steps, the blocks of its computed tokens and no more (a chunk's are taken when it is scheduled,
        # and those only rejected drafts were written to go back after the step)
        assert len(seq.block_table) == -(-seq.num_computed_tokens // block_size), seq
        holders.update(seq.block_table)
        for i, block_id in enumerate(seq.block_table):
            block = manager.blocks[block_id]
            if block.block_hash is not None:  # a cached block is full, computed, and holds this sequence's tokens
                assert (i + 1) * block_size <= seq.num_computed_tokens, (seq, block_id)
                assert block.token_ids == tuple(seq.token_slice(i * block_size, (i + 1) * block_size)), (seq, block_id)
    for block in manager.blocks:
        assert block.ref_count == holders[block.block_id], (block.block_id, block.ref_count, holders[block.block_id])
        assert (block.ref_count == 0) == (block.block_id in manager.free_block_ids), block.block_id
        if block.block_hash is not None:
            assert manager.cached_block_ids.get(block.block_hash) == block.block_id, block.block_id
    for block_hash, block_id in manager.cached_block_ids.items():
        assert manager.blocks[block_id].block_hash == block_hash, block_id
    assert sum(seq.num_seats for seq in scheduler.running) <= engine.config.max_num_seqs
    live = {id(seq) for seqs in engine.requests.values() for seq in seqs}
    assert live == {id(seq) for seq in [*scheduler.running, *scheduler.waiting]}
    for seq in finished:
        assert seq.is_finished and not seq.block_table, seq
