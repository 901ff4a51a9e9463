"""Tensors on transparent huge pages (2 MiB): the KV cache's blocks lie anywhere in hundreds of MB, and the
packed weights are streamed through once per step, so with 4 KiB pages nearly every block read and every few
KB of weights cost a TLB miss, and the hardware prefetcher, which stops at a page's end, starts again. Linux
only, and only where THP is enabled (`always` or `madvise`); elsewhere a plain tensor, which works the same, only
slower.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import threading

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in as if written, leaving their contents as they are
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype), 2 MiB-aligned and advised onto huge pages before it is first touched.

    An anonymous mapping reads as zeros and takes memory only where it is written: a KV pool costs what its used
    blocks hold, not its whole size, until the blocks fill."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if num_bytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    # private and anonymous (not shared memory, which THP madvise does not cover): zero-filled page by page on first touch
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    offset = -buffer.data_ptr() % HUGE_PAGE
    advise(buffer.data_ptr() + offset, num_bytes)
    return buffer[offset : offset + num_bytes].view(dtype).view(shape)


def cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat of 1-D tensors of one dtype, on huge pages."""
    out = zeros((sum(t.numel() for t in tensors),), tensors[0].dtype)
    return torch.cat(tensors, out=out) if out.numel() else out


def copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy on huge pages."""
    out = zeros(tuple(tensor.shape), tensor.dtype)
    return out.copy_(tensor)


def advise(address: int, num_bytes: int) -> bool:
    length = num_bytes // HUGE_PAGE * HUGE_PAGE
    if length == 0:
        return False
    return _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0


def populate_in_background(regions: list[tuple[torch.Tensor, int]]) -> threading.Thread:
    """Fault in the first num_bytes of each tensor (whole huge pages where it lies on them) in a thread of its own,
    without writing to them: safe while other threads write there. The kernel zero-fills each huge page on its
    first touch (~1 GB/s in a VM's fresh memory), which would otherwise fall on the first requests' steps. A no-op
    on kernels without MADV_POPULATE_WRITE."""

    def populate() -> None:
        for tensor, num_bytes in regions:  # the list keeps the tensors alive until done
            start = tensor.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
            end = tensor.data_ptr() + min(num_bytes, tensor.numel() * tensor.element_size())
            if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_POPULATE_WRITE) != 0:
                return

    thread = threading.Thread(target=populate, name="sluice-populate", daemon=True)
    thread.start()
    return thread
