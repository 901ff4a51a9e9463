"""The runner with a paged KV cache against the reference model's full forward pass."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.batch import SampledToken, SamplingRow, SeqChunk, StepBatch
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.models.loader import load_model

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


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_paged_chunked_prefill_and_decode_match_full_forward(kind: str, tiny_llama_dir: Path, tiny_gpt2_dir: Path) -> None:
    model_dir = tiny_llama_dir if kind == "llama" else tiny_gpt2_dir
    config = EngineConfig(model=str(model_dir), dtype="float32", quantize="none", block_size=BLOCK_SIZE,
                          num_kv_blocks=96)  # fmt: skip
    sampler = RecordingSampler()
    runner = ModelRunner(load_model(config), config, sampler=sampler)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    rng = random.Random(0)
    free = list(range(config.num_kv_blocks))
    rng.shuffle(free)  # non-contiguous, unordered block tables

    def new_seq(seq_id: int, prompt: list[int], shared: list[int] = ()) -> Seq:
        need = (len(prompt) + 24) // BLOCK_SIZE + 1 - len(shared)
        return Seq(seq_id, prompt, [*shared, *(free.pop() for _ in range(need))])

    vocab = runner.model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (37, 5, 50)]
    a, b, c = new_seq(0, prompts[0]), new_seq(1, prompts[1]), new_seq(2, prompts[2])
    checked: list[tuple[list[int], int]] = []  # (token prefix, index in sampler.rows)

    def record(sampled: list[tuple[Seq, int]]) -> None:
        for seq, n in sampled:
            checked.append((seq.tokens[:n], len(checked)))

    record(run_step(runner, [(a, 16), (b, 99), (c, 20)]))  # a, c: partial prefills; b: whole prompt
    record(run_step(runner, [(b, 1), (a, 99), (c, 13)]))  # decode of b mixed with prefill chunks
    # d shares a's first two full blocks (prefix cache hit): its first chunk starts at position 8
    d = new_seq(3, prompts[0][:8] + [rng.randrange(vocab) for _ in range(9)], shared=a.blocks[:2])
    d.num_computed = 2 * BLOCK_SIZE
    record(run_step(runner, [(c, 99), (d, 99), (a, 1), (b, 1)]))
    # the same decode batch for several steps (the runner appends to its stage, and re-gathers when a sequence
    # outgrows it), then a different one
    for _ in range(12):
        record(run_step(runner, [(s, 1) for s in (a, b, c, d)]))
    for _ in range(2):
        record(run_step(runner, [(s, 1) for s in (d, b, a)]))
    for _ in range(3):  # few rows take another attention kernel
        record(run_step(runner, [(s, 1) for s in (b, a)]))
    assert len(checked) == 2 + 2 + 3 + 48 + 6 + 6

    for prefix, index in checked:
        with torch.inference_mode():
            expected = reference(torch.tensor([prefix])).logits[0, -1]
        torch.testing.assert_close(sampler.rows[index], expected, atol=2e-4, rtol=1e-4)


def test_batch_without_sampling_returns_nothing(tiny_llama_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), block_size=BLOCK_SIZE, num_kv_blocks=8)
    runner = ModelRunner(load_model(config), config, sampler=RecordingSampler())
    assert runner.run(StepBatch([SeqChunk(0, [1, 2, 3, 4, 5], 0, [3, 1], None)])).sampled == []


def test_warmup_and_default_sampler(tiny_llama_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), block_size=BLOCK_SIZE, num_kv_blocks=8)
    runner = ModelRunner(load_model(config), config)
    runner.warmup()
    assert (runner.num_kv_blocks, runner.block_size) == (8, BLOCK_SIZE)
    out = runner.run(StepBatch([SeqChunk(0, [1, 2, 3], 0, [5], greedy_row())])).sampled
    assert len(out) == 1 and 0 <= out[0].token_id < runner.model.config.vocab_size
