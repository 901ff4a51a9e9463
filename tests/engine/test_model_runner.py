"""The runner with a paged KV cache against the reference model's full forward pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.batch import SeqChunk, StepBatch
from engine.config import EngineConfig
from engine.kv_pool import blocks_of
from engine.model_runner import ModelRunner
from engine.loader import load_model

from tests.support.runner_parity import BLOCK_SIZE, ParityRun, RecordingSampler, greedy_row


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_paged_chunked_prefill_and_decode_match_full_forward(
    kind: str, tiny_llama_dir: Path, tiny_gpt2_dir: Path
) -> None:
    model_dir = tiny_llama_dir if kind == "llama" else tiny_gpt2_dir
    config = EngineConfig(model=str(model_dir), dtype="float32", quantize="none", block_size=BLOCK_SIZE,
                          num_kv_blocks=96)  # fmt: skip
    sampler = RecordingSampler()
    runner = ModelRunner(load_model(config), config, sampler=sampler)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    run = ParityRun(runner, sampler)
    a, b, c, d = run.prefill_in_chunks_with_a_prefix_hit()
    # the same decode batch for several steps (the runner appends to its stage, and re-gathers when a sequence
    # outgrows it), then a different one
    for _ in range(12):
        run.step([(s, 1) for s in (a, b, c, d)])
    for _ in range(2):
        run.step([(s, 1) for s in (d, b, a)])
    for _ in range(3):  # few rows take another attention kernel
        run.step([(s, 1) for s in (b, a)])
    assert len(run.checked) == 2 + 2 + 3 + 48 + 6 + 6

    for recorded, expected in run.recorded_and_expected(reference):
        torch.testing.assert_close(recorded, expected, atol=2e-4, rtol=1e-4)


def test_batch_without_sampling_returns_nothing(tiny_llama_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), block_size=BLOCK_SIZE, num_kv_blocks=8)
    runner = ModelRunner(load_model(config), config, sampler=RecordingSampler())
    assert runner.run(StepBatch([SeqChunk(0, [1, 2, 3, 4, 5], 0, [3, 1], None)])).sampled == []


def test_warm_up_and_default_sampler(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), block_size=BLOCK_SIZE, num_kv_blocks=8)
    forwards: list[list[int]] = []
    backend_class = type(load_model(config).backend)
    forward = backend_class.forward
    monkeypatch.setattr(backend_class, "forward",
                        lambda self, batch: forwards.append([len(c.token_ids) for c in batch.chunks]) or forward(self, batch))  # fmt: skip
    runner = ModelRunner(load_model(config), config)
    assert forwards == [[min(2 * BLOCK_SIZE - 1, 16)], [1]]  # the load warmed the backend: a prefill, then a decode
    # on a cache of its own: the pool's pages are not written (populate_in_background faults them in meanwhile)
    assert not any(cache.any() for cache in runner.k_caches + runner.v_caches)
    assert (runner.num_kv_blocks, runner.block_size) == (8, BLOCK_SIZE)
    out = runner.run(StepBatch([SeqChunk(0, [1, 2, 3], 0, [5], greedy_row())])).sampled
    assert len(out) == 1 and 0 <= out[0].token_id < runner.vocab_size
    written, before = (blocks_of(runner.backend, runner.k_caches[0], b) for b in (5, slice(0, 5)))
    assert written.any() and not before.any()  # the step wrote its own block
