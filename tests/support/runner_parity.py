"""Stepping a ModelRunner by hand: sequences on shuffled blocks, chunked prefills, and every logits row kept
for comparison with a reference model's full forward pass (used by the model-runner and native tests)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch

from engine.batch import SampledToken, SamplingRow, SeqChunk, StepBatch
from engine.model_runner import ModelRunner

BLOCK_SIZE = 4


def greedy_row() -> SamplingRow:
    return SamplingRow(0.0, -1, 1.0, 0.0, 0.0, 0.0, 1.0, None, None, 0, [], [])


class RecordingSampler:
    """Greedy, and keeps every logits row it was given (in call order)."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        assert logits.dtype == torch.float32 and logits.shape[0] == len(rows)
        self.rows.extend(logits.clone())
        return [SampledToken(int(t)) for t in logits.argmax(dim=-1)]


class Seq:
    def __init__(self, seq_id: int, prompt: list[int], blocks: list[int]) -> None:
        self.seq_id, self.tokens, self.blocks = seq_id, list(prompt), blocks
        self.num_computed = 0  # positions whose K/V is in the cache
        self.prompt_len = len(prompt)

    def chunk(self, n: int) -> SeqChunk:
        end = min(self.num_computed + n, len(self.tokens))
        sampling = greedy_row() if end == len(self.tokens) else None
        return SeqChunk(self.seq_id, self.tokens[self.num_computed : end], self.num_computed, self.blocks, sampling)


def run_step(runner: ModelRunner, plan: list[tuple[Seq, int]]) -> list[tuple[Seq, int]]:
    """Feed up to n tokens of each listed sequence; append sampled tokens; return (seq, token count) that sampled."""
    chunks = [seq.chunk(n) for seq, n in plan]
    out = runner.run(StepBatch(chunks)).sampled
    sampled = [(seq, c) for (seq, _), c in zip(plan, chunks) if c.sampling is not None]
    assert len(out) == len(sampled)
    for (seq, _), chunk in zip(plan, chunks):
        seq.num_computed += chunk.num_tokens
    result = []
    for (seq, chunk), token in zip(sampled, out):
        result.append((seq, len(seq.tokens)))
        seq.tokens.append(token.token_id)
    return result


class ParityRun:
    """Sequences on shuffled (non-contiguous, unordered) blocks, stepped through a runner whose RecordingSampler
    keeps every logits row; each row is recorded with the token prefix whose next-token logits it should be."""

    def __init__(self, runner: ModelRunner, sampler: RecordingSampler) -> None:
        self.runner, self.sampler = runner, sampler
        self.rng = random.Random(0)
        self.free = list(range(runner.num_kv_blocks))
        self.rng.shuffle(self.free)
        self.checked: list[tuple[list[int], int]] = []  # (token prefix, index in sampler.rows)

    def new_seq(self, seq_id: int, prompt: list[int], shared: list[int] = ()) -> Seq:
        need = (len(prompt) + 24) // BLOCK_SIZE + 1 - len(shared)
        return Seq(seq_id, prompt, [*shared, *(self.free.pop() for _ in range(need))])

    def random_tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.runner.vocab_size) for _ in range(n)]

    def step(self, plan: list[tuple[Seq, int]]) -> None:
        for seq, n in run_step(self.runner, plan):
            self.checked.append((seq.tokens[:n], len(self.checked)))

    def prefill_in_chunks_with_a_prefix_hit(self) -> list[Seq]:
        """Three steps of partial and whole prefills mixed with a decode, then a fourth sequence that shares the
        first's two full blocks (a prefix-cache hit). Returns the four sequences, each with a token to decode."""
        a, b, c = (self.new_seq(i, self.random_tokens(n)) for i, n in enumerate((37, 5, 50)))
        self.step([(a, 16), (b, 99), (c, 20)])  # a, c: partial prefills; b: whole prompt
        self.step([(b, 1), (a, 99), (c, 13)])  # decode of b mixed with prefill chunks
        d = self.new_seq(3, a.tokens[:8] + self.random_tokens(9), shared=a.blocks[:2])
        d.num_computed = 2 * BLOCK_SIZE  # its first chunk starts at position 8
        self.step([(c, 99), (d, 99), (a, 1), (b, 1)])
        return [a, b, c, d]

    def recorded_and_expected(self, reference: torch.nn.Module) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each recorded logits row with the reference model's full forward pass over its prefix."""
        for prefix, index in self.checked:
            with torch.inference_mode():
                yield self.sampler.rows[index], reference(torch.tensor([prefix])).logits[0, -1]
