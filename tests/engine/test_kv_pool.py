"""The KV pool's layouts: the native step's block-major pool keeps the first blocks of every KV head of a layer in
its first huge page (what a first request touches), the eager path's head-major one a page per head."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.huge_pages import HUGE_PAGE
from engine.kv_pool import KVPool, blocks_of, layer_shape


def backend(is_block_major: bool) -> SimpleNamespace:
    return SimpleNamespace(is_kv_block_major=is_block_major, num_layers=2, num_kv_heads=3, head_dim=64)


def test_a_block_major_pool_keeps_the_first_blocks_of_all_heads_in_one_huge_page() -> None:
    native, num_blocks, block_size = backend(True), 1024, 16
    pool = KVPool.allocate(native, num_blocks, block_size, torch.bfloat16)
    assert tuple(pool.k[0].shape) == layer_shape(native, num_blocks, block_size) == (num_blocks, 3, block_size, 64)
    first = HUGE_PAGE // (3 * block_size * 64 * 2)  # blocks whose rows of every head fill one huge page
    for cache in pool.k + pool.v:
        rows = blocks_of(native, cache, slice(0, first))
        assert cache.data_ptr() % HUGE_PAGE == 0 and rows.data_ptr() == cache.data_ptr() and rows.is_contiguous()
        assert rows.numel() * rows.element_size() <= HUGE_PAGE
    assert pool.fits(native, num_blocks, block_size, torch.bfloat16)
    assert not pool.fits(backend(False), num_blocks, block_size, torch.bfloat16)


def test_blocks_of_names_the_same_rows_in_both_layouts() -> None:
    values = torch.randn(3, 10, 4, 8)  # [KVH, blocks, block_size, D]
    head_major, block_major = backend(False), backend(True)
    for blocks in (7, slice(2, 5)):
        a = blocks_of(head_major, values, blocks)
        b = blocks_of(block_major, values.transpose(0, 1).contiguous(), blocks)
        assert torch.equal(a.transpose(0, 1) if isinstance(blocks, slice) else a, b)
