"""KV caches on transparent huge pages: the same zeros, 2 MiB-aligned and advised when large enough."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import huge_pages


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


def _rss_kb() -> int:
    return int(next(line for line in Path("/proc/self/status").read_text().split("\n") if line.startswith("VmRSS:")).split()[1])


def test_a_pool_takes_memory_only_where_it_is_written() -> None:
    before = _rss_kb()
    t = huge_pages.zeros((256 << 20,), torch.uint8)
    assert _rss_kb() - before < 32 << 10  # kB: far below the 256 MiB asked for
    t[: 64 << 20].fill_(1)
    assert _rss_kb() - before >= 60 << 10
    assert not t[64 << 20 :].any()  # the rest still reads as zeros


def test_populating_faults_pages_in_and_keeps_what_they_hold() -> None:
    t = huge_pages.zeros((64 << 20,), torch.uint8)
    t[: 1 << 20].fill_(7)  # written before: kept
    before = _rss_kb()
    huge_pages.populate_in_background([(t[: 32 << 20], 32 << 20), (t[48 << 20 :], 1 << 20)]).join()
    grown = _rss_kb() - before
    if grown < 30 << 10:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    assert grown < 40 << 10  # kB: the 33 MiB asked for (whole huge pages), not the 64
    assert bool((t[: 1 << 20] == 7).all()) and not t[1 << 20 :].any()
