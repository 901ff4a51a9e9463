"""Runs one engine step on the model: hands the step's chunks to the model's StepBackend (native or eager, see
engine/step_backend.py), turns the rows it wants into logits, samples.

The only code that runs in the worker thread. It owns the paged KV cache tensors but makes no decisions:
which blocks a sequence uses is the block manager's business (slot = block_id * block_size + offset).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.batch import SampledToken, SamplingRow, SeqChunk, StepBatch, StepOutput
from engine.config import EngineConfig
from engine.kv_pool import KVPool
from engine.loader import LoadedModel
from engine.sampler import token_logprobs

SamplerFn = Callable[[torch.Tensor, list[SamplingRow]], list[SampledToken]]

# Prompt scoring turns this many hidden rows into float32 logits at a time (49152-token vocabulary: 25 MB).
SCORING_ROWS_PER_SLICE = 128


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, sampler: SamplerFn | None = None) -> None:
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        self.num_threads = torch.get_num_threads()
        self.backend = loaded.backend  # native or eager (engine/step_backend.py), chosen at load
        self.dtype = loaded.dtype
        self.block_size = config.block_size
        self.num_kv_blocks = config.num_kv_blocks
        self.vocab_size = min(len(loaded.tokenizer), loaded.vocab_size)
        if sampler is None:
            from engine.sampler import Sampler

            sampler = Sampler(vocab_size=self.vocab_size)
        self.sampler = sampler
        geometry = (self.backend, config.num_kv_blocks, config.block_size, self.dtype)
        pool, loaded.kv_pool = loaded.kv_pool, None  # a runner's own: taken once
        if pool is None or not pool.fits(*geometry):
            pool = KVPool.allocate(*geometry)
        self.k_caches, self.v_caches = pool.k, pool.v
        self.backend.bind_kv_caches(self.k_caches, self.v_caches)

    def run(self, batch: StepBatch) -> StepOutput:
        """Feed every chunk's tokens, then sample one token for each chunk with sampling set (one per row of a
        verification query), in chunk order, and score the prompt tokens that chunks ask for."""
        with torch.inference_mode():
            step = self.backend.forward(batch)
            last_rows = step.last_rows()
            output = StepOutput([], self._score_prompts(step.hidden, batch.chunks, last_rows))
            sample_index: list[int] = []
            rows: list[SamplingRow] = []
            for c, chunk_rows in zip(batch.chunks, step.chunk_rows):
                if c.verify_rows is not None:  # a verification query samples at each of its positions
                    sample_index += chunk_rows
                    rows += c.verify_rows
                elif c.sampling is not None:
                    sample_index.append(chunk_rows[-1])
                    rows.append(c.sampling)
            if sample_index:
                logits = self.backend.compute_logits(step.hidden[torch.tensor(sample_index)])
                output.sampled = self.sampler(logits, rows)
            return output

    def _score_prompts(
        self, hidden: torch.Tensor, chunks: list[SeqChunk], last_rows: list[int]
    ) -> dict[int, list[SampledToken]]:
        """seq_id -> the logprob each scoring row gives the prompt token after it (rows in slices, so that
        the float32 logits of a long chunk stay small)."""
        scores: dict[int, list[SampledToken]] = {}
        for chunk, last_row in zip(chunks, last_rows):
            scoring = chunk.prompt_scoring
            if scoring is None or not scoring.target_ids:
                continue
            first_row = last_row - chunk.num_tokens + 1
            scored = scores[chunk.seq_id] = []
            for start in range(0, len(scoring.target_ids), SCORING_ROWS_PER_SLICE):
                targets = scoring.target_ids[start : start + SCORING_ROWS_PER_SLICE]
                rows = hidden[first_row + start : first_row + start + len(targets)]
                logits = self.backend.compute_logits(rows)[:, : self.vocab_size].float()
                scored += token_logprobs(logits, torch.tensor(targets), [scoring.num_top] * len(targets))
        return scores
