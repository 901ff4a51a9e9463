"""A GGUF's config, built without the architecture's config class, holds every value the class itself builds from the
same metadata: for each architecture, with each key a file may state left out, and for both real models."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from transformers import AutoConfig
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

from engine.checkpoint.gguf_config import complete_config, metadata_values
from engine.checkpoint.source import default_gguf_path, open_checkpoint
from engine.config import EngineConfig
from engine.models.packaged import gemma3_270m_gguf

# what no forward pass reads: training, heads for other tasks, output switches, the loader's own notes
UNREAD = {
    "transformers_version", "_name_or_path", "id2label", "label2id", "initializer_range", "output_hidden_states",
    "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "problem_type",
    "architectures", "dtype", "use_cache",
}  # fmt: skip
# a value for each key of transformers' GGUF table, unlike every class default
STATED = {
    "context_length": 4096, "block_count": 7, "feed_forward_length": 96, "embedding_length": 64,
    "rope.dimension_count": 32, "rope.freq_base": 500000.0, "attention.head_count": 4, "attention.head_count_kv": 2,
    "attention.layer_norm_rms_epsilon": 1e-5, "attention.key_length": 32, "attention.sliding_window": 256,
    "vocab_size": 300,
}  # fmt: skip


def assert_same_as_the_class(metadata: dict[str, Any], tensors: dict[str, Any]) -> None:
    model_type, values = metadata_values(metadata, tensors)
    ours = complete_config(model_type, values)
    theirs = AutoConfig.for_model(model_type, **values)
    assert type(ours) is not type(theirs) and ours.model_type == theirs.model_type
    for key, value in theirs.to_dict().items():
        if key not in UNREAD and key != "model_type":
            assert getattr(ours, key, "absent") == value, (model_type, key)


def _metadata(arch: str, left_out: str | None) -> dict[str, Any]:
    file_arch = "llama" if arch == "mistral" else arch  # llama.cpp writes Mistral as llama, named Mistral
    metadata: dict[str, Any] = {"general.architecture": file_arch, "general.name": arch.title(), "tokenizer.ggml.tokens": 300}
    for key in GGUF_CONFIG_MAPPING[arch]:
        if key in STATED and key != left_out:
            metadata[f"{file_arch}.{key}"] = STATED[key]
    return metadata


ARCHES = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]  # (a GPT-2 GGUF is refused by gguf_names)


@pytest.mark.parametrize("arch", ARCHES)
def test_each_architecture_gets_the_values_its_config_class_gives(arch: str) -> None:
    assert set(STATED) >= {k for k, v in GGUF_CONFIG_MAPPING[arch].items() if v not in (None, -1)}
    for left_out in [None, *(k for k in STATED if k in GGUF_CONFIG_MAPPING[arch])]:
        for tensors in ({}, {"lm_head.weight": None}):  # tied and untied
            assert_same_as_the_class(_metadata(arch, left_out), tensors)


@pytest.mark.parametrize("which", ["default", "gemma3"])
def test_the_real_models_get_the_values_their_config_classes_give(which: str) -> None:
    path = default_gguf_path() if which == "default" else gemma3_270m_gguf(EngineConfig().cache_path)
    checkpoint = open_checkpoint(str(path))
    assert_same_as_the_class(dict(checkpoint.metadata), checkpoint.tensors)


def test_an_architecture_sluice_does_not_run_is_named() -> None:
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'"):
        metadata_values({"general.architecture": "falcon"}, {})


def test_a_gguf_config_imports_no_config_class() -> None:
    """The class would import transformers' activations, and with them torch.distributed.tensor and sympy (~1 s)."""
    code = (
        "import sys; from engine.checkpoint.source import default_gguf_path, open_checkpoint\n"
        "config = open_checkpoint(str(default_gguf_path())).hf_config\n"
        "assert config.num_hidden_layers == 30 and config.rope_parameters['rope_theta'] == 100000.0, config\n"
        "print(sorted(m for m in sys.modules if m.startswith(('transformers.models.', 'torch.distributed.tensor', 'sympy'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_mistral_file_attends_to_all_of_its_context_and_a_qwen3_file_has_its_key_length() -> None:
    """transformers' Mistral class gives a 4096-token window to a file that states none (llama.cpp runs Mistral
    files, written as llama, with full attention); a Qwen 3 file's head size is its attention.key_length, where
    transformers' table leaves it to the class default (128)."""
    mistral = complete_config(*metadata_values(_metadata("mistral", None), {}))
    assert mistral.model_type == "mistral" and mistral.sliding_window is None
    metadata = {**_metadata("qwen3", None), "qwen3.attention.key_length": 32}
    assert complete_config(*metadata_values(metadata, {})).head_dim == 32
    assert_same_as_the_class(metadata, {})  # the class given the same head size
