"""The paged KV pool: per layer a K and a V tensor in the backend's layout (layer_shape) on huge pages, reading as
zeros and taking memory where written. The loader allocates it as soon as the model's shape is known, so that the
first blocks' pages fault in while it still builds the tokenizer; the model runner then owns it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import huge_pages
from engine.step_backend import StepBackend


@dataclass
class KVPool:
    k: list[torch.Tensor]  # per layer
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, backend: StepBackend, num_blocks: int, block_size: int, dtype: torch.dtype) -> KVPool:
        shape = layer_shape(backend, num_blocks, block_size)
        k = [huge_pages.zeros(shape, dtype) for _ in range(backend.num_layers)]
        v = [huge_pages.zeros(shape, dtype) for _ in range(backend.num_layers)]
        # The first requests' blocks (handed out from 0 up) lie in the first huge page of each run of blocks: one
        # per layer and K/V when blocks are the outer dimension, one per KV head too when heads are. The kernel
        # zero-fills a page on first touch (~1 GB/s in a VM's fresh memory): faulted in now, not in the first steps.
        runs = k + v if backend.is_kv_block_major else [head for cache in k + v for head in cache]
        huge_pages.populate_in_background([(run, huge_pages.HUGE_PAGE) for run in runs])
        return cls(k, v)

    def fits(self, backend: StepBackend, num_blocks: int, block_size: int, dtype: torch.dtype) -> bool:
        shape = layer_shape(backend, num_blocks, block_size)
        return len(self.k) == backend.num_layers and tuple(self.k[0].shape) == shape and self.k[0].dtype == dtype


def layer_shape(backend: StepBackend, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    """One layer's K (or V) cache in the backend's layout."""
    if backend.is_kv_block_major:
        return (num_blocks, backend.num_kv_heads, block_size, backend.head_dim)
    return (backend.num_kv_heads, num_blocks, block_size, backend.head_dim)


def blocks_of(backend: StepBackend, cache: torch.Tensor, blocks: int | slice) -> torch.Tensor:
    """The rows of every KV head in `blocks` of one layer's cache, whichever the layout (a view)."""
    return cache[blocks] if backend.is_kv_block_major else cache[:, blocks]
