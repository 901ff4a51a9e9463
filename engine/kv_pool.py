"""The paged KV pool: per layer a K and a V tensor [KV heads, blocks, block_size, head_dim] on huge pages, reading
as zeros and taking memory where written. The loader allocates it as soon as the model's shape is known, so that
the first blocks' pages fault in while it still builds the tokenizer; the model runner then owns it."""

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
        shape = _layer_shape(backend, num_blocks, block_size)
        k = [huge_pages.zeros(shape, dtype) for _ in range(backend.num_layers)]
        v = [huge_pages.zeros(shape, dtype) for _ in range(backend.num_layers)]
        # The first requests' blocks (handed out from 0 up) lie in the first huge page of each KV head's run of
        # blocks: a page per layer, K/V and KV head (0.5 GB on a 1B model), zero-filled by the kernel on first
        # touch (~1 GB/s in a VM's fresh memory), faulted in meanwhile rather than in the first steps.
        huge_pages.populate_in_background([(head, huge_pages.HUGE_PAGE) for cache in k + v for head in cache])
        return cls(k, v)

    def fits(self, backend: StepBackend, num_blocks: int, block_size: int, dtype: torch.dtype) -> bool:
        shape = _layer_shape(backend, num_blocks, block_size)
        return len(self.k) == backend.num_layers and tuple(self.k[0].shape) == shape and self.k[0].dtype == dtype


def _layer_shape(backend: StepBackend, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    return (backend.num_kv_heads, num_blocks, block_size, backend.head_dim)
