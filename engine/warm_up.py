"""A backend's first steps, run at load so that the first request is not slow: its first prefill pays the kernels'
first touches (~0.1 s on a 1B model: scratch pages, lazily built dispatch) on top of the step itself."""

from __future__ import annotations

import torch

from engine.batch import SeqChunk, StepBatch
from engine.kv_pool import KVPool, layer_shape
from engine.step_backend import StepBackend


def warm_up(backend: StepBackend, pool: KVPool, block_size: int, max_model_len: int) -> None:
    """Run a prefill and a decode step on a KV cache of their own (writing the pool's first blocks would fault in
    their huge pages, which KVPool does without holding up the start), then bind the backend to the pool. Their
    positions stay below max_model_len (the native step's rope table ends there)."""
    blocks = [0, 1]
    n = min(2 * block_size - 1, 16, max_model_len - 1)
    shape = layer_shape(backend, len(blocks), block_size)
    caches = [torch.zeros(shape, dtype=pool.k[0].dtype) for _ in range(2 * backend.num_layers)]
    backend.bind_kv_caches(caches[::2], caches[1::2])
    prefill = SeqChunk(seq_id=-1, token_ids=[0] * n, start_pos=0, block_table=blocks, sampling=None)
    decode = SeqChunk(seq_id=-1, token_ids=[0], start_pos=n, block_table=blocks, sampling=None)
    try:
        with torch.inference_mode():
            for batch in ([StepBatch([prefill])] if n else []) + [StepBatch([decode])]:
                step = backend.forward(batch)
                backend.compute_logits(step.hidden[-1:])
    finally:
        backend.bind_kv_caches(pool.k, pool.v)
