"""Shared pieces of the engine tests: a transformers greedy reference and engine construction."""

from __future__ import annotations

import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from engine.llm import LLM
from engine.llm_engine import LLMEngine


@lru_cache(maxsize=4)
def hf_model(model_path: str, dtype: str = "float32"):
    """transformers' own model of a folder, or of a GGUF file (dequantised by transformers: the file's values)."""
    path = Path(model_path)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)).eval()
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()


def hf_greedy(model_dir: Path | str, prompt_ids: list[int], max_new_tokens: int, dtype: str = "float32") -> list[int]:
    """transformers generate(do_sample=False), never stopping early: the reference for greedy parity."""
    model = hf_model(str(model_dir), dtype)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=config, eos_token_id=None)
    return out[0, len(prompt_ids) :].tolist()


def make_llm(model_dir: Path | str, **overrides) -> LLM:
    settings = dict(dtype="float32", quantize="none", num_kv_blocks=256, block_size=4, max_num_seqs=16)
    settings.update(overrides)
    return LLM(str(model_dir), **settings)


def assert_pool_full(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests
    assert engine.num_free_blocks == engine.num_total_blocks, (engine.num_free_blocks, engine.num_total_blocks)


def slow_steps(engine: LLMEngine, seconds: float) -> None:
    """Make every forward pass take at least `seconds`, so that timing-based tests do not race a fast CPU."""
    real_execute = engine.execute

    def slow_execute(plan: Any) -> Any:
        time.sleep(seconds)
        return real_execute(plan)

    engine.execute = slow_execute  # type: ignore[method-assign]
