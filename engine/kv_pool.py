"""The paged KV pool: per layer a K and a V tensor in the backend's layout (layer_shape) on huge pages, reading as
zeros and taking memory where written. The loader allocates it as soon as the model's shape is known, so that the
first blocks' pages fault in while it still builds the tokenizer; the model runner then owns it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

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
        check_fits_in_memory(2 * backend.num_layers * math.prod(shape) * dtype.itemsize, num_blocks, block_size)
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


MEMORY_FRACTION = 0.9  # of the memory available, the most a KV pool may take
_memory_share = [1.0]  # of the available memory this process's pool may take


def share_memory(num_pools: int) -> None:
    """This process's pool is one of num_pools on this machine (engine replicas): each may take that share of the
    memory available, since each checks alone and an untouched pool holds none of it yet."""
    _memory_share[0] = 1.0 / num_pools


def check_fits_in_memory(num_bytes: int, num_blocks: int, block_size: int) -> None:
    """A pool takes memory as its blocks fill, so one larger than the memory left would start and serve, then grow
    into the OOM killer hours later (every never-used block is handed out before a freed one is reused): refused."""
    available = available_memory_bytes()
    if available is not None:
        available = int(available * _memory_share[0])
    # at most 90%: the process's own memory (weights, activations, Python) grows too as the pool fills
    if available is not None and num_bytes > MEMORY_FRACTION * available:
        num_fitting = int(num_blocks * MEMORY_FRACTION * available / num_bytes)
        advice = f"num_kv_blocks = {num_fitting} would fit" if num_fitting else "a smaller block_size is needed"
        raise ValueError(
            f"the KV pool of num_kv_blocks = {num_blocks} of block_size = {block_size} tokens needs "
            f"{num_bytes / 2**30:.1f} GiB, more than 90% of the {available / 2**30:.1f} GiB of memory available"
            f"{f' to each of {round(1 / _memory_share[0])} replicas' if _memory_share[0] < 1 else ''}: {advice}"
        )


def available_memory_bytes() -> int | None:
    """What the kernel says this process may still take (Linux: MemAvailable, within a cgroup's limit); None
    elsewhere."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in meminfo.splitlines() if ":" in line)
    if "MemAvailable" not in fields:
        return None
    available = int(fields["MemAvailable"].split()[0]) * 1024
    try:  # cgroup v2: a container's limit, less what it uses
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available


def layer_shape(backend: StepBackend, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    """One layer's K (or V) cache in the backend's layout."""
    if backend.is_kv_block_major:
        return (num_blocks, backend.num_kv_heads, block_size, backend.head_dim)
    return (backend.num_kv_heads, num_blocks, block_size, backend.head_dim)


def blocks_of(backend: StepBackend, cache: torch.Tensor, blocks: int | slice) -> torch.Tensor:
    """The rows of every KV head in `blocks` of one layer's cache, whichever the layout (a view)."""
    return cache[blocks] if backend.is_kv_block_major else cache[:, blocks]
