from engine.block_manager import BlockManager, hash_block
from engine.input_processor import PreparedRequest
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, PreparedRequest(f"r{seq_id}", tokens, SamplingParams(max_tokens=8), 8), detokenizer=None)


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    assert bm.allocate_slots(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_hash_chains_over_the_prefix():
    assert hash_block(0, [1, 2]) == hash_block(0, [1, 2])
    assert hash_block(0, [1, 2]) != hash_block(1, [1, 2])
    assert hash_block(0, [1, 2]) != hash_block(0, [2, 1])


def test_allocate_and_free_restore_the_pool():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(0, list(range(10)))
    assert bm.allocate_slots(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert not bm.allocate_slots(make_seq(1, list(range(40))), 40)  # too many: nothing changes
    assert bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_prefix_hit_shares_full_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(0, list(range(12)))
    compute_all(bm, first)
    second = make_seq(1, list(range(12)))
    # 12 tokens = 3 full blocks, but the last token must be computed for its logits: 2 blocks are reused.
    assert bm.allocate_cached_prefix(second) == 8
    assert second.block_table == first.block_table[:2]
    assert bm.blocks[first.block_table[0]].ref_count == 2
    third = make_seq(2, list(range(8)) + [99, 98, 97, 96, 95])
    assert bm.allocate_cached_prefix(third) == 8
    other = make_seq(3, [5] + list(range(1, 12)))
    assert bm.allocate_cached_prefix(other) == 0
    for seq in (first, second, third, other):
        bm.free(seq)
    assert bm.num_free_blocks == 16


def test_freed_cached_blocks_are_reused_later_and_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = make_seq(0, [1, 2, 3, 4, 5])
    compute_all(bm, seq)
    bm.free(seq)
    assert bm.num_free_blocks == 4
    again = make_seq(1, [1, 2, 3, 4, 5])
    assert bm.allocate_cached_prefix(again) == 4  # cached blocks survive while free
    bm.free(again)
    # Fill the whole pool with other tokens: the cached blocks get evicted and the cache forgets them.
    filler = make_seq(2, [9] * 8)
    assert bm.allocate_slots(filler, 8)
    bm.free(filler)
    assert bm.allocate_cached_prefix(make_seq(3, [1, 2, 3, 4, 5])) == 0


def test_hash_hit_is_checked_against_token_ids():
    bm = BlockManager(num_blocks=8, block_size=2)
    seq = make_seq(0, [1, 2, 3])
    compute_all(bm, seq)
    block = bm.blocks[seq.block_table[0]]
    block.token_ids = (7, 7)  # simulate a hash collision: same hash, other tokens
    assert bm.allocate_cached_prefix(make_seq(1, [1, 2, 3])) == 0


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    seq = make_seq(0, [1, 2, 3, 4, 5])
    compute_all(bm, seq)
    assert bm.allocate_cached_prefix(make_seq(1, [1, 2, 3, 4, 5])) == 0
