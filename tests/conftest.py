from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.engine_helpers import assert_pool_full, make_llm
from tests.support.tiny_models import save_tiny_gemma3, save_tiny_gpt2, save_tiny_llama, save_tiny_qwen3


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory) -> Path:
    return save_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3"))


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory) -> Path:
    return save_tiny_gpt2(tmp_path_factory.mktemp("tiny_gpt2"))


@pytest.fixture(scope="session")
def default_llm():
    """The real default model (SmolLM2-135M-Instruct GGUF), in float32 so greedy parity with transformers is exact."""
    from engine import LLM

    return LLM("", dtype="float32", quantize="none", num_kv_blocks=512, max_num_seqs=16)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    """A small float32 engine on the tiny Llama, one per test module."""
    return make_llm(tiny_llama_dir)


@pytest.fixture(autouse=True)
def pool_returns_to_full(request):
    """After every test that used an engine: nothing left unfinished, every KV block back in the pool."""
    yield
    for name in ("llm", "default_llm"):
        if name in request.fixturenames:
            assert_pool_full(request.getfixturevalue(name))
