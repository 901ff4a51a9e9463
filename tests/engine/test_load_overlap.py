"""The loader packs the weights in worker threads (the layers shared out among them) while it builds the config and
tokenizer: the weights it hands over are those packed in order on one thread, and a Llama-family model the native
step cannot run still loads, on the eager path."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine.checkpoint.source import open_checkpoint
from engine.config import EngineConfig
from engine.kv_pool import layer_shape
from engine.loader import load_model
from engine.native import native_ops
from engine.native.native_backend import NativeBackend

from tests.support.tiny_models import save_tiny_llama


def test_weights_packed_ahead_give_the_bits_of_weights_packed_in_order(tiny_llama_dir: Path) -> None:
    ops = native_ops()
    assert ops is not None, "the native step is built by `make install`"
    config = EngineConfig(model=str(tiny_llama_dir), num_threads=2)
    ahead = load_model(config).backend
    checkpoint = open_checkpoint(str(tiny_llama_dir))
    in_order = NativeBackend(ops, checkpoint.hf_config, checkpoint.tensors, 512, config.precision)
    assert ahead.name == "native" and ahead.plan == in_order.plan
    shape = layer_shape(in_order, 4, 16)
    hidden = []
    for backend in (ahead, in_order):
        backend.bind_kv_caches([torch.zeros(shape, dtype=torch.bfloat16) for _ in range(backend.num_layers)],
                               [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(backend.num_layers)])
        n = 37
        hidden.append(backend.run_tokens(
            torch.arange(3, 3 + n), torch.arange(n), torch.arange(n), torch.zeros(n, dtype=torch.int32),
            torch.arange(4, dtype=torch.int32).view(1, 4),
        ))  # fmt: skip
    assert torch.equal(hidden[0], hidden[1])


def test_a_llama_the_native_step_cannot_run_loads_on_the_eager_path(tmp_path: Path, caplog) -> None:
    # head_dim 12: no native kernel; its packing ahead (hidden 48, not whole groups of 32) fails and is dropped
    path = save_tiny_llama(tmp_path / "odd", hidden_size=48, intermediate_size=96, num_attention_heads=4)
    with caplog.at_level(logging.WARNING, logger="engine.loader"):
        loaded = load_model(EngineConfig(model=str(path)))
    assert loaded.backend.name == "eager"
    assert "the native step cannot run this model" in caplog.text
    assert torch.get_num_threads() >= 1


def test_a_load_that_fails_restores_the_thread_count(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    (tmp_path / "weird").mkdir()
    (tmp_path / "weird" / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    with pytest.raises(ValueError, match="BertModel"):
        load_model(EngineConfig(model=str(tmp_path / "weird")))
    assert torch.get_num_threads() == before
