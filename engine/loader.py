"""Open the model where it lies and choose its forward path: the native step when it is built and runs this
model, else the eager PyTorch model (built only then). Says at start what runs: the architecture, each stored
type, and the path that runs it.

transformers supplies configs, tokenizers and chat templates; the forward pass is ours.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from engine.checkpoint.source import open_checkpoint, served_name
from engine.checkpoint.stored_tensor import type_counts
from engine.config import EngineConfig
from engine.kv_pool import KVPool
from engine.models.chat_templates import chat_format, read_chat_template
from engine.models.registry import model_class
from engine.native.native_backend import NativeBackend, PackedWeights, check_shapes, pack_weights, unsupported_reason
from engine.step_backend import StepBackend
from engine.warm_up import warm_up

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
M_MMAP_THRESHOLD = -3  # mallopt parameter number, glibc's malloc.h
LOAD_MMAP_THRESHOLD = 1 << 20
RUN_MMAP_THRESHOLD = 32 << 20  # where glibc's sliding threshold ends up anyway


@dataclass
class LoadedModel:
    backend: StepBackend  # the forward path that runs this model: native or eager, holding its own weights
    hf_config: Any  # transformers PretrainedConfig
    tokenizer: Any  # transformers fast tokenizer, chat template included
    path: Path  # the .gguf file or Hugging Face folder read
    name: str  # served model name
    eos_token_ids: set[int]
    max_position_embeddings: int
    vocab_size: int
    dtype: torch.dtype
    kv_pool: KVPool | None  # allocated for the config's geometry; the model runner takes it
    longest_token_chars: int | None = None  # the vocabulary's longest string, where the checkpoint counts it


# What a file's contents can raise past the checks that name what is wrong (a tensor the file lacks, a type the
# conversion has no rule for, a vocabulary the tokenizer library refuses): the caller gets a ValueError naming the
# file (one line from the CLI and the server), this error chained for the traceback
_FILE_FAULTS = (KeyError, IndexError, TypeError, ZeroDivisionError, OverflowError, NotImplementedError, RuntimeError)


def load_model(config: EngineConfig) -> LoadedModel:
    _map_large_allocations(LOAD_MMAP_THRESHOLD)
    try:
        return _load(config)
    except _FILE_FAULTS as error:
        detail = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
        model = config.model or "default"
        raise ValueError(f"the model {model} cannot be run: {type(error).__name__}: {detail}") from error
    finally:
        _map_large_allocations(RUN_MMAP_THRESHOLD)
        _give_back_freed_memory()


def _load(config: EngineConfig) -> LoadedModel:
    template = read_chat_template(config.chat_template) if config.chat_template else None  # before the long part
    checkpoint = open_checkpoint(config.model, config.cache_path)
    ops = _native_ops(config)
    # The weights pack on every core, outside the GIL (0.3-1 s of a 1B model), while this thread builds the config
    # and the tokenizer under it (0.1 s; 0.5 s where header_cache has no entry yet, 4 s of a 262k vocabulary).
    num_threads = config.num_threads if config.num_threads > 0 else torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-load") as pool:
            packs = ops is not None and _is_llama_family(checkpoint)
            packing = pool.submit(pack_weights, ops, checkpoint.tensors, num_threads) if packs else None
            hf_config = checkpoint.hf_config
            model_class(hf_config)  # every architecture has an eager model (the reference): else a clear error here
            checkpoint.check_tokenizer()
            if _is_llama_family(checkpoint):
                check_shapes(hf_config, checkpoint.tensors)
            max_pos = int(getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions"))
            tokenizer = checkpoint.tokenizer()
            backend = _native_backend(checkpoint, config, min(max_pos, config.max_model_len), ops, packing)
            del packing  # an unused result goes with it
    finally:
        torch.set_num_threads(num_threads)
    dtype = DTYPES[config.dtype]
    if backend is None:
        from engine.models.eager_build import build_eager

        backend = build_eager(checkpoint, config, dtype)
    kv_pool = KVPool.allocate(backend, config.num_kv_blocks, config.block_size, dtype)
    warm_up(backend, kv_pool, config.block_size, min(max_pos, config.max_model_len))
    fmt = chat_format(getattr(hf_config, "model_type", ""))
    if template is not None:
        tokenizer.chat_template = template
        log.info("chat template: the configured one (chat_template), not the model's")
    elif not tokenizer.chat_template and fmt is not None:
        log.info("the model carries no chat template: using %s's own", hf_config.model_type)
        tokenizer.chat_template = fmt.template
    eos = checkpoint.eos_token_ids() or ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    for token in fmt.end_of_turn if fmt else ():
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            eos.add(token_id)
    path, longest_token_chars = checkpoint.path, checkpoint.longest_token_chars()
    del checkpoint  # unmaps the file: the backend holds its own packed copies
    return LoadedModel(
        backend=backend,
        hf_config=hf_config,
        tokenizer=tokenizer,
        path=path,
        name=served_name(config.model, config.cache_path),
        eos_token_ids=eos,
        max_position_embeddings=max_pos,
        vocab_size=int(hf_config.vocab_size),
        dtype=dtype,
        kv_pool=kv_pool,
        longest_token_chars=longest_token_chars,
    )


def _native_ops(config: EngineConfig) -> ModuleType | None:
    """The native step's module if this config runs it, else None (and says why)."""
    if config.quantize == "none" or config.dtype != "bfloat16":
        # float32 stays the exact dense reference; a server chosen so is told what it gave up
        log.warning("eager PyTorch path (the reference, about 10x slower than the native step, not batch-invariant):"
                    " dtype %s, quantize %s; the native step runs dtype bfloat16 with quantize auto or requantize",
                    config.dtype, config.quantize)  # fmt: skip
        return None
    from engine.native import native_ops

    return native_ops()  # None says why


def _is_llama_family(checkpoint: Any) -> bool:
    """Named as the native step's models are (whether it runs this one is known once the config is built)."""
    try:
        names = checkpoint.tensors
    except ValueError:
        return False  # no weights: said once the config is known to be one Sluice runs
    return "model.layers.0.self_attn.q_proj.weight" in names and "model.embed_tokens.weight" in names


def _native_backend(checkpoint: Any, config: EngineConfig, max_positions: int, ops: ModuleType | None,
                    packing: Future[PackedWeights] | None) -> StepBackend | None:  # fmt: skip
    """The native step if it runs this model in this config, else None; says which and why either way."""
    types = ", ".join(f"{n} x {t}" for t, n in sorted(type_counts(checkpoint.tensors).items()))
    log.info("model %s: architecture %s, tensors %s", checkpoint.path, checkpoint.architecture, types)
    if ops is None:
        return None
    reason = unsupported_reason(checkpoint.hf_config, checkpoint.tensors)
    if reason is not None:
        if packing is not None:
            packing.exception()  # waits, and drops any error of packing what the native step does not run
        log.warning("the native step cannot run this model (%s); using the eager PyTorch path", reason)
        return None
    weights = packing.result() if packing is not None else None
    backend = NativeBackend(ops, checkpoint.hf_config, checkpoint.tensors, max_positions, config.precision, weights)
    log.info("native step: %s kernels, precision %s", ops.isa(), config.precision)
    for type_name, layouts in sorted(backend.plan.exact.items()):
        log.info("native step: %s tensors run on their own grid (%s layout)", type_name, "/".join(sorted(layouts)))
    _refuse_requantised(backend.plan.requantised, config.quantize)
    for type_name, layouts in sorted(backend.plan.requantised.items()):
        for layout in sorted(layouts):
            if type_name in FLOAT_TYPES:
                log.info("native step: %s tensors are quantised onto %s", type_name, layout)
            elif layout == "Q8":  # its one float16 scale per 32 holds no other grid
                log.warning("native step: the embedding / lm_head's %s tensors are re-quantised onto Q8", type_name)
            else:
                log.warning("native step: %s tensors are re-quantised onto %s (quantize = \"requantize\")", type_name,
                            layout)  # fmt: skip
    return backend


FLOAT_TYPES = ("F32", "F16", "BF16")


def _refuse_requantised(requantised: dict[str, set[str]], quantize: str) -> None:
    """A layer's quantised type with no kernel of its own would be rounded a second time onto Q4: its output drifts
    from the file's (0.5-0.7 nats on a 1B's greedy tokens), so it runs only when asked for."""
    lossy = sorted(t for t, layouts in requantised.items() if t not in FLOAT_TYPES and layouts - {"Q8"})
    if lossy and quantize != "requantize":
        raise ValueError(
            f"{', '.join(lossy)} weights have no native kernel (the native step runs Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
            f"Q4_K, Q5_K, Q6_K and float layers): run them exactly on the eager PyTorch path with quantize = "
            f'"none" (slower), or natively re-quantised onto Q4 with quantize = "requantize" (a second rounding: '
            f"the output drifts from the file's)"
        )


def _glibc() -> Any | None:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def _map_large_allocations(threshold: int) -> None:
    """glibc's mmap threshold, fixed (no longer raised by each large free): a load's transient buffers of a few
    MB each then come from and go back to the system instead of fragmenting the heap (measured on a 279 MiB
    GGUF: +824 MiB peak with glibc's sliding threshold)."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, threshold)


def _give_back_freed_memory() -> None:
    """Return the heap's free pages to the system (glibc keeps the transient unpacking buffers of the load
    otherwise: ~100 MB for the default model)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
