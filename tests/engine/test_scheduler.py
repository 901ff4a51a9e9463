"""The scheduler against a simulated forward pass (pure Python: every step 'samples' token 7)."""

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.input_processor import PreparedRequest
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, caching=True):
    config = EngineConfig(
        num_kv_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget
    )
    bm = BlockManager(num_blocks, block_size, caching)
    return Scheduler(config, bm), bm


def add(sched: Scheduler, seq_id: int, num_prompt: int, max_tokens: int, first_token: int = 0) -> Sequence:
    tokens = [first_token + seq_id * 1000 + i for i in range(num_prompt)]
    seq = Sequence(seq_id, PreparedRequest(f"r{seq_id}", tokens, SamplingParams(max_tokens=max_tokens), max_tokens), None)
    sched.add(seq)
    return seq


def run_step(sched: Scheduler) -> list:
    chunks = sched.schedule()
    sampling = [c for c in chunks if c.is_sampling]
    sched.on_computed(chunks)
    for chunk in sampling:
        seq = chunk.seq
        seq.output_token_ids.append(7)
        if seq.num_output_tokens >= seq.max_tokens:
            sched.finish(seq)
    return chunks


def run_all(sched: Scheduler, max_steps: int = 1000) -> int:
    for step in range(max_steps):
        if not sched.has_unfinished:
            return step
        run_step(sched)
    raise AssertionError("did not finish")


def test_budget_chunks_a_long_prompt_and_mixes_it_with_decodes():
    sched, bm = make(budget=16)
    short = add(sched, 0, 4, 10)
    run_step(sched)  # short prefilled
    long = add(sched, 1, 40, 2)
    chunks = run_step(sched)
    sizes = {c.seq.seq_id: c.num_tokens for c in chunks}
    assert sizes == {0: 1, 1: 15}  # one decode plus a 15-token prefill chunk within the 16-token budget
    assert long.num_computed_tokens == 15 and long.num_output_tokens == 0
    chunks = run_step(sched)
    assert {c.seq.seq_id: c.num_tokens for c in chunks} == {0: 1, 1: 15}
    chunks = run_step(sched)
    assert {c.seq.seq_id: c.num_tokens for c in chunks} == {0: 1, 1: 10}
    assert long.num_output_tokens == 1 and short.num_output_tokens == 4
    run_all(sched)
    assert bm.num_free_blocks == bm.num_blocks


def test_max_num_seqs_bounds_the_running_batch():
    sched, bm = make(max_num_seqs=3, budget=64)
    for i in range(5):
        add(sched, i, 3, 4)
    chunks = run_step(sched)
    assert len(chunks) == 3 and len(sched.waiting) == 2
    run_all(sched)
    assert bm.num_free_blocks == bm.num_blocks


def test_preemption_when_blocks_run_out_then_everything_finishes():
    sched, bm = make(num_blocks=6, block_size=4, max_num_seqs=4, budget=64, caching=False)
    seqs = [add(sched, i, 6, 8) for i in range(3)]  # each needs 4 blocks at the end; the pool has 6
    run_all(sched)
    assert sched.num_preemptions > 0
    assert all(s.num_output_tokens == 8 for s in seqs)
    assert bm.num_free_blocks == bm.num_blocks


def test_preempted_sequence_recomputes_prompt_and_output():
    sched, bm = make(num_blocks=4, block_size=4, max_num_seqs=2, budget=64, caching=False)
    a = add(sched, 0, 7, 8)
    b = add(sched, 1, 7, 8)
    while b.status is not SequenceStatus.WAITING or b.num_output_tokens == 0:
        run_step(sched)
    assert b.num_computed_tokens == 0 and b.block_table == [] and sched.waiting[0] is b
    num_output = b.num_output_tokens
    while a.status is not SequenceStatus.FINISHED:
        run_step(sched)
    chunks = run_step(sched)
    assert [(c.seq, c.num_tokens) for c in chunks] == [(b, 7 + num_output)]
    run_all(sched)
    assert bm.num_free_blocks == bm.num_blocks


def test_finish_frees_blocks_from_any_state():
    sched, bm = make(budget=8)
    waiting = add(sched, 0, 30, 4)
    sched.schedule()  # prefilling: 8 of 30 tokens scheduled, blocks held
    assert bm.num_free_blocks < bm.num_blocks
    sched.finish(waiting)
    sched.finish(waiting)  # idempotent
    queued = add(sched, 1, 3, 4)
    sched.finish(queued)
    assert not sched.has_unfinished and bm.num_free_blocks == bm.num_blocks


def test_prefix_cache_hit_skips_computed_blocks():
    sched, bm = make(budget=64)
    add(sched, 0, 13, 1, first_token=5)
    run_all(sched)
    seq = Sequence(9, PreparedRequest("r9", [5 + i for i in range(13)], SamplingParams(max_tokens=1), 1), None)
    sched.add(seq)
    chunks = run_step(sched)
    assert chunks[0].num_tokens == 1 and seq.num_cached_tokens == 12
    assert bm.prefix_cache_hit_rate == 12 / 26


class FixedDrafts:
    """A speculator that offers every decoding sequence the same drafts."""

    is_enabled = True

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts
        self.num_running_seen: list[int] = []

    def propose(self, seq: Sequence, num_running: int) -> list[int]:
        self.num_running_seen.append(num_running)
        return list(self.drafts)


def test_drafts_take_only_blocks_and_budget_no_running_sequence_needs():
    sched, bm = make(num_blocks=4, block_size=4, budget=64, caching=False)
    a, b = add(sched, 0, 4, 8), add(sched, 1, 4, 8)
    run_step(sched)  # both prefilled into a block each and sampled once: each decode needs a new block
    sched.speculator = FixedDrafts([7, 7, 7, 7])
    chunks = sched.schedule()
    # a's four drafts would take both free blocks and preempt b; each gets a block and the drafts it leaves room for
    assert sched.num_preemptions == 0 and bm.num_free_blocks == 0
    assert [(c.seq, c.num_tokens, c.draft_token_ids) for c in chunks] == [(a, 4, [7, 7, 7]), (b, 4, [7, 7, 7])]
    assert sched.speculator.num_running_seen == [2, 2]
    sched.on_computed(chunks)  # every draft rejected: the blocks they alone held go back
    assert bm.num_free_blocks == 0 and a.num_computed_tokens == b.num_computed_tokens == 5


def test_drafts_never_crowd_a_running_sequence_out_of_the_budget():
    sched, bm = make(max_num_seqs=3, budget=6)
    seqs = [add(sched, i, 2, 8) for i in range(3)]
    run_step(sched)
    sched.speculator = FixedDrafts([7, 7, 7, 7])
    chunks = sched.schedule()
    # every decode first (3 tokens), then drafts from what is left of the 6: the first sequence's 3
    assert [(c.seq, c.num_tokens) for c in chunks] == [(seqs[0], 4), (seqs[1], 1), (seqs[2], 1)]
