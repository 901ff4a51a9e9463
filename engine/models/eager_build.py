"""Build the eager backend from a checkpoint: our nn.Module, filled one stored tensor at a time (a GGUF tensor is
dequantised alone, then copied in and dropped), plus the optional int4 copies of its linears for small batches."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import nn

from engine.config import EngineConfig
from engine.models.eager_backend import EagerBackend
from engine.models.layers import INT4_GROUP_SIZE, Linear
from engine.models.registry import model_class

QUANT_CACHE_MIN_BYTES = 64 << 20

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_eager(checkpoint: Any, config: EngineConfig, dtype: torch.dtype) -> EagerBackend:
    """`checkpoint`: an engine.checkpoint GGUFCheckpoint or FolderCheckpoint (hf_config, tensors, path)."""
    cls = model_class(checkpoint.hf_config)
    quantize = config.quantize != "none" and dtype == torch.bfloat16
    quantised = sorted({t.type_name for t in checkpoint.tensors.values()} - {"F32", "F16", "BF16"})
    if quantize and quantised:  # the no-compiler fallback: said, not refused (that would leave nothing to run)
        log.warning("eager path: the file's %s tensors are re-quantised onto int4 (a second rounding; quantize = "
                    "\"none\" runs them exactly)", ", ".join(quantised))  # fmt: skip
    quant_file = _quant_cache_file(checkpoint.path, dtype, config.cache_path) if quantize else None
    # quantising reads the checkpoint's own (float32) values; otherwise build in dtype and cast while loading
    exact = quantize and not (quant_file and quant_file.is_file())
    with _default_dtype(torch.float32 if exact else dtype):
        model = cls(checkpoint.hf_config)
    model.load_weights(_one_at_a_time(checkpoint.tensors))
    if quantize:
        quantize_model(model, dtype, quant_file)  # cached for large models: quantising takes seconds
    model.to(dtype).eval()
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
    return EagerBackend(model, dtype, config.block_size, use_int4=quantize)


def _one_at_a_time(tensors: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Each stored tensor as float32, its file pages released once the model has copied it."""
    for name, tensor in tensors.items():
        yield name, tensor.to_float()
        tensor.release()


def _quant_cache_file(path: Path, dtype: torch.dtype, cache_root: Path) -> Path | None:
    """Where the int4 copies of a model are cached; None for small models, quick to quantise on load."""
    # the packed int4 layout is torch's own: a new torch version re-quantises
    parts = [torch.__version__, str(dtype), str(INT4_GROUP_SIZE), "int4-layers"]
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    total = 0
    for file in files:
        stat = file.stat()
        parts.append(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}")
        total += stat.st_size
    if total < QUANT_CACHE_MIN_BYTES:
        return None
    digest = xxhash.xxh64_hexdigest("\n".join(parts).encode())[:12]
    return cache_root / "quantized" / f"{path.stem}-{digest}.safetensors"


def quantize_model(model: nn.Module, dtype: torch.dtype, cache_file: Path | None = None) -> None:
    """Add int4 copies next to the dense weights of the layers' linears, for small batches. Not the lm_head:
    4 bits change its greedy picks, and int8 measured no faster than the packed bf16 head."""
    from safetensors.torch import load_file, save_file

    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    if cache_file is not None and cache_file.is_file():
        tensors = load_file(cache_file)
        for name, module in linears.items():
            if f"{name}.qweight" in tensors:
                module.qweight, module.qscales = tensors[f"{name}.qweight"], tensors[f"{name}.qscales"]
                module.qbits = 4
        return

    for name, module in linears.items():
        if name != "lm_head":
            module.quantize_int4(dtype)
    if cache_file is not None:
        tensors = {}
        for name, module in linears.items():
            if module.qbits:
                tensors[f"{name}.qweight"], tensors[f"{name}.qscales"] = module.qweight, module.qscales
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{cache_file.name}.", dir=cache_file.parent)
        os.close(fd)
        try:
            save_file(tensors, tmp)
            os.replace(tmp, cache_file)  # atomic: concurrent loaders see the old state or the whole file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
