"""KV caches on transparent huge pages: the same zeros, 2 MiB-aligned and advised when large enough."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from pathlib import Path

import pytest
import torch

from engine import huge_pages

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


@pytest.mark.parametrize("shape, dtype", [((3, 700, 16, 64), torch.bfloat16), ((5, 7), torch.float32)])
def test_zeros_are_zeros_of_the_asked_shape_and_large_ones_are_aligned(shape, dtype) -> None:
    t = huge_pages.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    if t.numel() * t.element_size() >= huge_pages.HUGE_PAGE:
        assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t.fill_(1)  # the whole range is writable
    assert t.all()


def test_large_caches_land_on_huge_pages_where_the_kernel_offers_them() -> None:
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("this kernel has no transparent huge pages")
    t = huge_pages.zeros((64 << 20,), torch.uint8)
    t.fill_(1)  # pages are taken when first written
    start, end = t.data_ptr(), t.data_ptr() + t.numel()
    for line in Path("/proc/self/smaps").read_text().split("\n"):
        if "-" in line.split(" ")[0] and not line.startswith(("Size", "Rss")):
            lo, hi = (int(x, 16) for x in line.split(" ")[0].split("-"))
            mapping = lo <= start < hi
        elif mapping and line.startswith("AnonHugePages:"):
            assert int(line.split()[1]) >= 32 << 10  # kB: at least half of it on huge pages
            return
    pytest.fail("the tensor's mapping was not found in /proc/self/smaps")


def _resident_mib(t: torch.Tensor, start: int, end: int) -> float:
    """MiB of bytes start .. end of t that are in memory (mincore): this mapping's own, whatever the rest of the
    process takes or frees meanwhile."""
    page = mmap.PAGESIZE
    first = (t.data_ptr() + start) // page * page
    num_pages = -(-(t.data_ptr() + end - first) // page)
    vec = (ctypes.c_ubyte * num_pages)()
    assert _libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(num_pages * page), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * page / (1 << 20)


def _can_populate() -> bool:
    """Whether this kernel has MADV_POPULATE_WRITE (Linux 5.14+): EINVAL where it does not."""
    probe = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(probe))
    return _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(mmap.PAGESIZE), huge_pages._MADV_POPULATE_WRITE) == 0


def test_a_pool_takes_memory_only_where_it_is_written() -> None:
    t = huge_pages.zeros((256 << 20,), torch.uint8)
    assert _resident_mib(t, 0, t.numel()) == 0  # none of the 256 MiB asked for
    t[: 64 << 20].fill_(1)
    assert 64 <= _resident_mib(t, 0, t.numel()) <= 66  # what was written (whole huge pages)
    assert not t[64 << 20 :].any()  # the rest still reads as zeros


def test_populating_faults_pages_in_and_keeps_what_they_hold() -> None:
    if not _can_populate():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    t = huge_pages.zeros((64 << 20,), torch.uint8)
    t[: 1 << 20].fill_(7)  # written before: kept
    huge_pages.populate_in_background([(t[: 32 << 20], 32 << 20), (t[48 << 20 :], 1 << 20)]).join()
    assert _resident_mib(t, 0, 32 << 20) == 32 and _resident_mib(t, 48 << 20, 49 << 20) == 1
    assert _resident_mib(t, 34 << 20, 46 << 20) == 0 and _resident_mib(t, 50 << 20, 64 << 20) == 0  # no more
    assert bool((t[: 1 << 20] == 7).all()) and not t[1 << 20 :].any()
