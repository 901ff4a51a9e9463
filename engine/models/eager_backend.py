"""The eager PyTorch forward path behind the StepBackend seam: our nn.Module, and the step's index / mask tensors
built for it (decodes first, then prefill spans). The reference and the fallback of the native step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.batch import SeqChunk, StepBatch
from engine.models.layers import LayerCache, PrefillSpan, StepContext
from engine.step_backend import StepHidden

# Weight-only int4 kernels beat packed bf16 matmuls up to about this many rows (measured in whole steps:
# 1 and 4 rows faster with int4, 16 slower).
QUANT_MAX_TOKENS = 8
# Decode attention through SDPA up to this many rows, by hand above (measured crossover).
DECODE_SDPA_MAX_ROWS = 2
# Extra blocks of room in a rebuilt decode stage: it is re-gathered when a sequence outgrows it.
STAGE_SLACK_BLOCKS = 2


@dataclass(frozen=True)
class _StageState:
    """Which decode batch the layers' stage tensors hold: reusable if the same sequences decode next step."""

    seq_ids: tuple[int, ...]
    next_positions: tuple[int, ...]
    length: int


class EagerBackend:
    name = "eager"
    is_kv_block_major = False  # [KVH, num_blocks, block_size, D]: paged_attention gathers a head's keys in one index

    def __init__(self, model: nn.Module, dtype: torch.dtype, block_size: int, use_int4: bool) -> None:
        self.model = model
        self.dtype = dtype
        self.block_size = block_size
        self.num_layers, self.num_kv_heads, self.head_dim = model.num_layers, model.num_kv_heads, model.head_dim
        self.quant_max_tokens = QUANT_MAX_TOKENS if use_int4 else 0
        self.kv_caches: list[LayerCache] = []
        self._stage: _StageState | None = None

    def bind_kv_caches(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        self.kv_caches = [LayerCache(kc, vc) for kc, vc in zip(k, v)]
        self._stage = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def forward(self, batch: StepBatch) -> StepHidden:
        input_ids, ctx, chunk_rows, stage = self._prepare(batch)
        self._stage = None  # until this forward pass has filled the stage
        hidden = self.model(input_ids, ctx, self.kv_caches)
        self._stage = stage
        return StepHidden(hidden, chunk_rows)

    def _slots(self, chunk: SeqChunk, start: int, end: int) -> list[int]:
        bs, table = self.block_size, chunk.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _prepare(self, batch: StepBatch) -> tuple[torch.Tensor, StepContext, list[range], _StageState | None]:
        """Flatten the batch, decodes first, and build every index / mask tensor the layers share."""
        decodes = [c for c in batch.chunks if c.num_tokens == 1]
        prefills = [c for c in batch.chunks if c.num_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        first_row: dict[int, int] = {}  # id(chunk) -> row of its first token

        for c in decodes:
            first_row[id(c)] = len(input_ids)
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
            first_row[id(c)] = start
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
        chunk_rows = [range(first_row[id(c)], first_row[id(c)] + c.num_tokens) for c in batch.chunks]
        return torch.tensor(input_ids, dtype=torch.int64), ctx, chunk_rows, stage
