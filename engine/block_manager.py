"""Paged-KV bookkeeping: a free list, reference counts and a prefix cache keyed by chained xxhash of full blocks.

A block is free when its reference count is 0. A free block may still hold a cached prefix (its hash stays
in the table) until it is handed out again; free blocks are handed out least recently freed first, so the
cache keeps what was used last. Only the event-loop thread calls this.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

import xxhash

from engine.sequence import Sequence


def hash_block(parent_hash: int, token_ids: list[int]) -> int:
    """Chained hash: a block's hash covers every token before it, so equal hashes mean equal prefixes."""
    hasher = xxhash.xxh3_64(parent_hash.to_bytes(8, "little"))
    hasher.update(array("q", token_ids).tobytes())
    return hasher.intdigest()


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # set once the block is full and registered in the cache
        self.token_ids: tuple[int, ...] = ()  # the cached block's tokens: a hash hit is checked against them


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_block_ids: dict[int, int] = {}  # block hash -> block id
        self.num_prefix_queries = 0  # prompt tokens looked up in the cache
        self.num_prefix_hits = 0  # of which found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        num_slots = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-num_slots // self.block_size) - len(seq.block_table))

    def num_fitting_tokens(self, seq: Sequence) -> int:
        """How many uncomputed tokens seq's blocks and the free ones hold."""
        num_slots = (len(seq.block_table) + len(self.free_block_ids)) * self.block_size
        return num_slots - seq.num_computed_tokens

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_block_ids)

    def update_hashes(self, seq: Sequence) -> None:
        """Extend seq.block_hashes to cover every full block of its tokens."""
        size = self.block_size
        for i in range(len(seq.block_hashes), seq.num_tokens // size):
            parent = seq.block_hashes[-1] if seq.block_hashes else 0
            seq.block_hashes.append(hash_block(parent, seq.token_slice(i * size, (i + 1) * size)))

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """For a sequence without blocks: take the cached blocks of its longest cached prefix.

        At least one token is always left to compute, since the step that computes it yields the logits.
        Returns the number of tokens now covered (seq.num_computed_tokens).
        """
        assert not seq.block_table and seq.num_computed_tokens == 0, seq
        if not self.enable_prefix_caching:
            return 0
        self.update_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for i, block_hash in enumerate(seq.block_hashes[:max_blocks]):
            block_id = self.cached_block_ids.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            tokens = seq.token_slice(i * self.block_size, (i + 1) * self.block_size)
            if block.token_ids != tuple(tokens):
                break
            self._take(block)
            seq.block_table.append(block_id)
        seq.num_registered_blocks = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens

    def share(self, source: Sequence, target: Sequence) -> None:
        """Give target (without blocks) source's blocks by reference, with the KV progress they hold. Only full
        blocks may be shared: a sequence writes its next tokens into the slots after its last computed one."""
        assert not target.block_table, target
        assert source.num_computed_tokens == len(source.block_table) * self.block_size, source
        for block_id in source.block_table:
            self._take(self.blocks[block_id])
        target.block_table = list(source.block_table)
        target.block_hashes = source.block_hashes[: len(source.block_table)]
        target.num_computed_tokens = source.num_computed_tokens
        target.num_registered_blocks = source.num_registered_blocks

    def record_prefix_query(self, num_tokens: int, num_hits: int) -> None:
        self.num_prefix_queries += num_tokens
        self.num_prefix_hits += num_hits

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give seq blocks for num_new_tokens more tokens; False (and no change) if too few are free."""
        num_needed = self.num_blocks_needed(seq, num_new_tokens)
        if num_needed > len(self.free_block_ids):
            return False
        for _ in range(num_needed):
            block_id, _ = self.free_block_ids.popitem(last=False)
            block = self.blocks[block_id]
            self._forget(block)
            block.ref_count = 1
            seq.block_table.append(block_id)
        return True

    def trim(self, seq: Sequence) -> None:
        """Free seq's tail blocks that hold no computed token (those a rejected draft was written to)."""
        num_kept = -(-seq.num_computed_tokens // self.block_size)
        while len(seq.block_table) > num_kept:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.block_hash is None, f"block {block.block_id} is not a draft's"
            block.ref_count = 0
            self.free_block_ids[block.block_id] = None
            self.free_block_ids.move_to_end(block.block_id, last=False)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that computation has filled, so later prompts can share them."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(seq)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                continue
            block_hash = seq.block_hashes[i]
            if block_hash in self.cached_block_ids:
                continue  # another block holds the same prefix; this one stays private
            block.block_hash = block_hash
            block.token_ids = tuple(seq.token_slice(i * self.block_size, (i + 1) * self.block_size))
            self.cached_block_ids[block_hash] = block.block_id
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def free(self, seq: Sequence) -> None:
        """Drop seq's references. Tail blocks are freed first so they are reused (evicted) first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_block_ids[block_id] = None
                    self.free_block_ids.move_to_end(block_id, last=False)  # uncached: reuse before cached ones
                else:
                    self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def _take(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.free_block_ids[block.block_id]
        block.ref_count += 1

    def _forget(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached_block_ids.get(block.block_hash) == block.block_id:
                del self.cached_block_ids[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
