"""Runs one engine step on the model: builds the step's tensors, runs the forward pass, samples.

The only code that runs in the worker thread. It owns the paged KV cache tensors but makes no decisions:
which blocks a sequence uses is the block manager's business (slot = block_id * block_size + offset).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import huge_pages
from engine.batch import SampledToken, SamplingRow, SeqChunk, StepBatch, StepOutput
from engine.config import EngineConfig
from engine.models.layers import LayerCache, PrefillSpan, StepContext
from engine.models.loader import LoadedModel
from engine.sampler import token_logprobs

SamplerFn = Callable[[torch.Tensor, list[SamplingRow]], list[SampledToken]]

# Weight-only int4 kernels beat packed bf16 matmuls up to about this many rows (measured in whole steps:
# 1 and 4 rows faster with int4, 16 slower).
QUANT_MAX_TOKENS = 8
# Decode attention through SDPA up to this many rows, by hand above (measured crossover).
DECODE_SDPA_MAX_ROWS = 2
# Prompt scoring turns this many hidden rows into float32 logits at a time (49152-token vocabulary: 25 MB).
SCORING_ROWS_PER_SLICE = 128
# Extra blocks of room in a rebuilt decode stage: it is re-gathered when a sequence outgrows it.
STAGE_SLACK_BLOCKS = 2


@dataclass(frozen=True)
class _StageState:
    """Which decode batch the layers' stage tensors hold: reusable if the same sequences decode next step."""

    seq_ids: tuple[int, ...]
    next_positions: tuple[int, ...]
    length: int


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, sampler: SamplerFn | None = None) -> None:
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        self.model = loaded.model
        self.dtype = loaded.dtype
        self.block_size = config.block_size
        self.num_kv_blocks = config.num_kv_blocks
        if sampler is None:
            from engine.sampler import Sampler

            sampler = Sampler(vocab_size=min(len(loaded.tokenizer), loaded.vocab_size))
        self.sampler = sampler
        self.vocab_size = min(len(loaded.tokenizer), loaded.vocab_size)
        self.num_kv_heads = self.model.num_kv_heads
        shape = (self.num_kv_heads, config.num_kv_blocks, config.block_size, self.model.head_dim)
        self.kv_caches = [
            LayerCache(huge_pages.zeros(shape, self.dtype), huge_pages.zeros(shape, self.dtype))
            for _ in range(self.model.num_layers)
        ]
        self._stage: _StageState | None = None
        self.quant_max_tokens = QUANT_MAX_TOKENS if config.quantize == "auto" else 0
        # the native step (one C++ call for all layers, GIL released) when the loader built one for this model;
        # it reads and writes the same paged caches in place
        self.native = loaded.native
        if self.native is not None:
            self.native.set_kv_caches([c.k for c in self.kv_caches], [c.v for c in self.kv_caches])
        self.compute_logits = self.model.compute_logits if self.native is None else self.native.compute_logits

    def run(self, batch: StepBatch) -> StepOutput:
        """Feed every chunk's tokens, then sample one token for each chunk with sampling set (one per row of a
        verification query), in chunk order, and score the prompt tokens that chunks ask for."""
        with torch.inference_mode():
            if self.native is not None:
                hidden, last_rows = self._forward_native(batch)
            else:
                input_ids, ctx, last_rows, stage = self._prepare(batch)
                self._stage = None  # until this forward pass has filled the stage
                hidden = self.model(input_ids, ctx, self.kv_caches)
                self._stage = stage
            output = StepOutput([], self._score_prompts(hidden, batch.chunks, last_rows))
            sample_index: list[int] = []
            rows: list[SamplingRow] = []
            for c, last_row in zip(batch.chunks, last_rows):
                if c.verify_rows is not None:  # a verification query samples at each of its positions
                    sample_index += range(last_row - c.num_tokens + 1, last_row + 1)
                    rows += c.verify_rows
                elif c.sampling is not None:
                    sample_index.append(last_row)
                    rows.append(c.sampling)
            if sample_index:
                logits = self.compute_logits(hidden[torch.tensor(sample_index)])
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
                logits = self.compute_logits(rows)[:, : self.vocab_size].float()
                scored += token_logprobs(logits, torch.tensor(targets), [scoring.num_top] * len(targets))
        return scores

    def warmup(self) -> None:
        """Run a prefill and a decode step through both kernel paths so the first request is not slow.

        Writes K/V into the first few blocks; they hold nothing yet, and later steps overwrite them.
        """
        blocks = list(range(min(4, self.num_kv_blocks)))
        n = min(len(blocks) * self.block_size - 1, 48)
        prefill = SeqChunk(seq_id=-1, token_ids=[0] * n, start_pos=0, block_table=blocks, sampling=None)
        decode = SeqChunk(seq_id=-1, token_ids=[0], start_pos=n, block_table=blocks, sampling=None)
        with torch.inference_mode():
            for batch in (StepBatch([prefill]), StepBatch([decode])):
                if self.native is not None:
                    hidden, _ = self._forward_native(batch)
                    self.compute_logits(hidden[-1:])
                    continue
                self._stage = None
                input_ids, ctx, _, _ = self._prepare(batch)
                hidden = self.model(input_ids, ctx, self.kv_caches)
                self.model.compute_logits(hidden[-1:])
        self._stage = None

    def _forward_native(self, batch: StepBatch) -> tuple[torch.Tensor, list[int]]:
        """The step's tokens in chunk order through the native step: [T, hidden], and each chunk's last row.
        Every token attends to positions 0 .. its own of its sequence, read in place through its block table."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        row_seq: list[int] = []
        last_rows: list[int] = []
        tables: list[int] = []  # [chunks, width] flat, each row padded with block 0
        width = max(len(c.block_table) for c in batch.chunks)
        for i, c in enumerate(batch.chunks):
            end = c.start_pos + c.num_tokens
            input_ids += c.token_ids
            positions += range(c.start_pos, end)
            slots += self._slots(c, c.start_pos, end)
            row_seq += [i] * c.num_tokens
            last_rows.append(len(input_ids) - 1)
            tables += c.block_table
            tables += [0] * (width - len(c.block_table))
        hidden = self.native.forward(
            torch.tensor(input_ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            torch.tensor(slots, dtype=torch.int64),
            torch.tensor(row_seq, dtype=torch.int32),
            torch.tensor(tables, dtype=torch.int32).view(len(batch.chunks), width),
        )
        return hidden, last_rows

    def _slots(self, chunk: SeqChunk, start: int, end: int) -> list[int]:
        bs, table = self.block_size, chunk.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _prepare(self, batch: StepBatch) -> tuple[torch.Tensor, StepContext, list[int], _StageState | None]:
        """Flatten the batch, decodes first, and build every index / mask tensor the layers share."""
        decodes = [c for c in batch.chunks if c.num_tokens == 1]
        prefills = [c for c in batch.chunks if c.num_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_row: dict[int, int] = {}  # id(chunk) -> row of its last token

        for c in decodes:
            last_row[id(c)] = len(input_ids)
            input_ids.append(c.token_ids[0])
            positions.append(c.start_pos)
            slots += self._slots(c, c.start_pos, c.start_pos + 1)

        decode_gather = decode_mask = decode_rows = stage = None
        if decodes:
            bs = self.block_size
            seq_ids = tuple(c.seq_id for c in decodes)
            starts = tuple(c.start_pos for c in decodes)
            old = self._stage
            if old is not None and old.seq_ids == seq_ids and old.next_positions == starts and max(starts) < old.length:
                length = old.length  # the same sequences, one position on: append to the stage
            else:
                num_blocks = [p // bs + 1 for p in starts]  # blocks covering [0, start_pos]
                width = max(num_blocks) + STAGE_SLACK_BLOCKS
                blocks: list[int] = []
                for c, nb in zip(decodes, num_blocks):
                    blocks += c.block_table[:nb]
                    blocks += [0] * (width - nb)
                decode_gather = torch.tensor(blocks, dtype=torch.int64)
                length = width * bs
            stage = _StageState(seq_ids, tuple(p + 1 for p in starts), length)
            kv_lens = torch.tensor(starts) + 1
            visible = torch.arange(length)[None, :] < kv_lens[:, None]  # [B, L]
            mask = torch.zeros(visible.shape, dtype=self.dtype).masked_fill_(~visible, float("-inf"))
            if len(decodes) <= DECODE_SDPA_MAX_ROWS:
                decode_mask = mask[:, None, None, :]
            else:
                decode_mask = mask.repeat(self.num_kv_heads, 1)[:, None, :]  # rows ordered (kv head, sequence)
            decode_rows = torch.arange(len(decodes))

        spans: list[PrefillSpan] = []
        for c in prefills:
            start, n, kv_len = len(input_ids), c.num_tokens, c.start_pos + c.num_tokens
            last_row[id(c)] = start + n - 1
            input_ids += c.token_ids
            positions += range(c.start_pos, kv_len)
            slots += self._slots(c, c.start_pos, kv_len)
            if c.start_pos == 0:
                spans.append(PrefillSpan(start, start + n, 0, kv_slots=None, mask=None))
            else:
                kv_slots = torch.tensor(self._slots(c, 0, kv_len), dtype=torch.int64)
                # query i sits at position start_pos + i and sees keys 0 .. start_pos + i
                mask = torch.ones(n, kv_len, dtype=torch.bool).tril(diagonal=c.start_pos)
                spans.append(PrefillSpan(start, start + n, c.start_pos, kv_slots=kv_slots, mask=mask))

        ctx = StepContext(
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_decode=len(decodes),
            decode_gather=decode_gather,
            decode_mask=decode_mask,
            decode_rows=decode_rows,
            decode_sdpa=len(decodes) <= DECODE_SDPA_MAX_ROWS,
            prefills=spans,
            use_quant=len(input_ids) <= self.quant_max_tokens,
        )
        last_rows = [last_row[id(c)] for c in batch.chunks]
        return torch.tensor(input_ids, dtype=torch.int64), ctx, last_rows, stage
