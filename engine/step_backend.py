"""The seam between the model runner and a forward path. The loader picks one implementation per model at load
(engine.native's NativeBackend, else engine.models' EagerBackend); each owns its weights and its preparation, and
the runner only hands it the step's chunks and asks for logits of the rows it wants.

Contract: `forward(batch)` feeds every chunk's tokens at positions start_pos.. (writing their K/V into the caches
bound by `bind_kv_caches`; each token attends to positions 0 .. its own of its sequence) and returns the hidden
states of all the step's tokens with the rows of each chunk. A verifier of k drafted tokens sends a chunk of 1 + k
tokens and asks `compute_logits` for the rows of all of them: every row of a chunk is a real position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.batch import StepBatch


@dataclass
class StepHidden:
    hidden: torch.Tensor  # [T, hidden] before the final norm, one row per token of the step
    chunk_rows: list[range]  # rows of hidden holding each chunk's tokens, in token order, chunks in batch order

    def last_rows(self) -> list[int]:
        return [rows[-1] for rows in self.chunk_rows]


class StepBackend(Protocol):
    name: str  # "native" or "eager", for the log and the tests
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # A layer's cache [num_blocks, KVH, block_size, head_dim] (the native step: a block's rows of every KV head
    # together) or [KVH, num_blocks, block_size, head_dim] (the eager path): see engine.kv_pool.layer_shape.
    is_kv_block_major: bool

    def bind_kv_caches(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """The runner's paged caches, one K and one V per layer, in the backend's layout (is_kv_block_major)."""

    def forward(self, batch: StepBatch) -> StepHidden: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] rows of StepHidden.hidden -> [N, vocab] float32 logits."""
        ...
