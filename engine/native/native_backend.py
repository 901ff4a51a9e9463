"""The native forward path behind the StepBackend seam: a Llama-family model's weights packed straight from the
checkpoint's stored tensors (one at a time; no model object, no float copy of the model), then one C++ call for
all layers of a step and one for the logits, each releasing the GIL for its whole run.

Each linear is packed on the file's own grid: the layers' Q4_0 / Q4_1 / Q4_K in the Q4 layout, their Q5_0 / Q5_1 /
Q5_K in the Q5 layout (the Q4 layout and the fifth bits: as few bytes as the file's), their Q6_K in the Q6 layout,
their Q8_0 in the Q8 layer layout (a fused q/k/v of several types runs each part in its own), a
Q8_0 / Q4_0 / Q5_0 embedding and head in the Q8 layout. Float tensors and types without a grid here are quantised onto Q4_1 / Q8_0 (the head's K-quants
too: its Q8 layout has one float16 scale per 32), and `plan` says so per tensor (the loader logs it).
The layers' Q4_0 / Q4_1 / Q4_K, Q5_0 / Q5_1 / Q5_K and Q6_K and a Q8_0 embedding and head are packed in C++ straight from the file's
blocks (block_packing.py); the rest in Python (packing.py's packers, the reference the C++ ones are tested against).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any

import torch

from engine import huge_pages
from engine.batch import StepBatch
from engine.checkpoint.block_grids import UNPACKERS, grid_of
from engine.checkpoint.stored_tensor import StoredTensor
from engine.native.block_packing import (
    Q4_FROM_BLOCKS,
    Q6_FROM_BLOCKS,
    Q8_FROM_BLOCKS,
    q4_from_blocks,
    q6_from_blocks,
    q8_from_blocks,
)
from engine.native.packing import (
    GROUP,
    PACK_ROWS,
    TILE,
    LinearSpec,
    Q4Packed,
    Q6Packed,
    Q8LayerPacked,
    Q8Packed,
    linear_spec,
    pack_q4,
    pack_q4_grid,
    pack_q6_grid,
    pack_q8,
    pack_q8_grid,
    pack_q8_layer_grid,
    q8_grid,
)
from engine.rope import layer_window, rope_tables
from engine.step_backend import StepHidden

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
HEAD_DIMS = (16, 32, 64, 128, 256)
UNIT_OFFSET_NORMS = ("gemma3_text",)  # norms scale by 1 + w (the stored w is Hugging Face's)
Q5_EXACT = ("Q5_0", "Q5_1", "Q5_K")  # the Q4 layout with the fifth bits of q (the Q5 layout)
Q4_EXACT = ("Q4_0", "Q4_1", "Q4_K", *Q5_EXACT)  # the layers' Q4 / Q5 layout holds these grids bit for bit
Q8_EXACT = ("Q8_0", "Q4_0", "Q5_0")  # symmetric per-32 grids: q - offset fits int8, the scale float16


@dataclass
class PackPlan:
    """How each stored type is run: exactly on its own grid, or re-quantised (and why)."""

    exact: dict[str, set[str]] = field(default_factory=dict)  # stored type -> layouts it was packed into
    requantised: dict[str, set[str]] = field(default_factory=dict)

    def note(self, type_name: str, layout: str, is_exact: bool) -> None:
        (self.exact if is_exact else self.requantised).setdefault(type_name, set()).add(layout)


def _attn_sizes(cfg: Any) -> tuple[int, int, int]:
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return heads, kv_heads, head_dim


def unsupported_reason(cfg: Any, tensors: Mapping[str, StoredTensor]) -> str | None:
    """Why the native step cannot run this model, or None if it can."""
    if cfg.model_type not in MODEL_TYPES:
        return f"architecture {cfg.model_type!r} has no native step yet (native: {', '.join(MODEL_TYPES)})"
    heads, _, head_dim = _attn_sizes(cfg)
    if cfg.hidden_size % GROUP or cfg.intermediate_size % GROUP or heads * head_dim % GROUP:
        return f"hidden / intermediate / attention sizes must be multiples of {GROUP}"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {HEAD_DIMS}"
    if "lm_head.bias" in tensors:
        return "lm_head has a bias"
    if getattr(cfg, "attn_logit_softcapping", None):
        return "attention logit soft-capping"
    return None


def _released(tensors: list[StoredTensor]) -> None:
    for t in tensors:
        t.release()


def _row_chunks(tensor: StoredTensor) -> Iterator[StoredTensor]:
    """PACK_ROWS rows at a time (a multiple of the tile height: each chunk packs into whole tiles), so that a
    tensor's unpacked grid or float copy is never whole in memory."""
    n = tensor.shape[0]
    for start in range(0, n, PACK_ROWS):
        yield tensor.row_slice(start, min(n, start + PACK_ROWS))


def _q4_pieces(tensor: StoredTensor, plan: PackPlan) -> Iterator[Q4Packed]:
    exact = tensor.type_name in Q4_EXACT
    for chunk in _row_chunks(tensor):
        if exact:
            grid = grid_of(chunk)
            q, scale, minv = (torch.from_numpy(a) for a in (grid.q, grid.scale, grid.minv))
            yield pack_q4_grid(q, scale, minv, None, grid.factors, tensor.type_name in Q5_EXACT)
        else:
            yield pack_q4(chunk.to_float(), None)
    plan.note(tensor.type_name, "Q5" if tensor.type_name in Q5_EXACT else "Q4", exact)


def _q6_pieces(tensor: StoredTensor, plan: PackPlan) -> Iterator[Q6Packed]:
    for chunk in _row_chunks(tensor):
        grid = grid_of(chunk)
        assert grid.factors is not None
        yield pack_q6_grid(torch.from_numpy(grid.q), grid.factors, None)
    plan.note(tensor.type_name, "Q6", True)


def _q8_layer_pieces(tensor: StoredTensor, plan: PackPlan) -> Iterator[Q8LayerPacked]:
    """Every grid block_grids unpacks has its q within int8: exact in the Q8 layer layout. Other types (float
    tensors, quant types without a grid here) are quantised onto Q8_0's grid."""
    exact = tensor.type_name in UNPACKERS
    for chunk in _row_chunks(tensor):
        if exact:
            grid = grid_of(chunk)
            minv = None if grid.minv is None else torch.from_numpy(grid.minv)
            yield pack_q8_layer_grid(torch.from_numpy(grid.q), torch.from_numpy(grid.scale), minv, None)
        else:
            yield pack_q8_layer_grid(*q8_grid(chunk.to_float()), None, None)
    plan.note(tensor.type_name, "Q8 layer", exact)


def _layout_of(tensor: StoredTensor) -> str:
    """The layout a layer's linear part runs in: its own grid's, or Q4 for a float tensor (quantised onto Q4_1)."""
    if tensor.type_name == "Q6_K":
        return "q6"
    if tensor.type_name in UNPACKERS and tensor.type_name not in Q4_EXACT:
        return "q8l"
    return "q4"


def _from_blocks(ops: ModuleType, run: list[StoredTensor], plan: PackPlan) -> Q4Packed | Q6Packed | None:
    """Parts of one type packed in C++ straight from the file's blocks into one joined output, where block_packing
    has their type and form."""
    packed: Q4Packed | Q6Packed | None = None
    type_name = run[0].type_name
    if type_name in Q6_FROM_BLOCKS:
        packed = q6_from_blocks(ops, *run)
    elif type_name in Q4_FROM_BLOCKS:
        packed = q4_from_blocks(ops, *run)
    if packed is not None:
        plan.note(type_name, "Q6" if isinstance(packed, Q6Packed) else "Q5" if packed.has_fifth_bits else "Q4", True)
    return packed


def _block_runs(parts: list[StoredTensor]) -> list[list[StoredTensor]]:
    """Neighbouring parts of one type block_packing packs, in runs (a fused q/k of Q4_K: one), the rest alone."""
    runs: list[list[StoredTensor]] = []
    for t in parts:
        joins = t.type_name in Q4_FROM_BLOCKS + Q6_FROM_BLOCKS
        if joins and runs and runs[-1][-1].type_name == t.type_name:
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs


def _packed_in_python(tensor: StoredTensor, plan: PackPlan) -> Q4Packed | Q8LayerPacked | Q6Packed:
    """One tensor of a linear in its layout, packed chunk by chunk in Python, the chunks' tiles joined."""
    layout = _layout_of(tensor)
    if layout == "q6":
        return _joined(list(_q6_pieces(tensor, plan)), tensor.shape[0])
    if layout == "q8l":
        return _joined(list(_q8_layer_pieces(tensor, plan)), tensor.shape[0])
    return _joined(list(_q4_pieces(tensor, plan)), tensor.shape[0])


def _joined(pieces: list, n: int, bias: torch.Tensor | None = None):
    """Pieces of one layout (whole tiles each) joined along N into one; a symmetric Q8 layer piece gets zero
    minimums when another piece has some."""
    first = pieces[0]
    skip = {"n", "bias"} | ({"minv"} if isinstance(first, Q8LayerPacked) else set())
    # on huge pages: every step streams each weight once (a 4 KiB page's end stops the prefetcher)
    joined = {
        name: huge_pages.cat([getattr(p, name) for p in pieces]) for name in first.__dataclass_fields__ if name not in skip
    }
    if isinstance(first, Q8LayerPacked):
        joined["minv"] = torch.empty(0)
        if any(p.minv.numel() for p in pieces):
            joined["minv"] = torch.cat([p.minv if p.minv.numel() else torch.zeros(p.qs.numel() // 32) for p in pieces])
    return type(first)(**joined, n=n, bias=bias if bias is not None else torch.empty(0))


def _can_join(a: Q4Packed | Q8LayerPacked | Q6Packed, b: Q4Packed | Q8LayerPacked | Q6Packed) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, Q8LayerPacked):
        return a.scale_group == b.scale_group  # type: ignore[union-attr]
    if isinstance(a, Q4Packed):
        return a.scale.dtype == b.scale.dtype and a.has_fifth_bits == b.has_fifth_bits  # type: ignore[union-attr]
    return True


def _linear(ops: ModuleType, parts: list[StoredTensor], bias: list[StoredTensor] | None, plan: PackPlan) -> LinearSpec:
    """Linears sharing an input, fused along N (q, k, v or gate, up): each part packed on its own grid, chunk by
    chunk, and the neighbouring parts of one layout joined into one run of tiles (whole tiles when every N is a
    multiple of the tile height); the stored tensors are released once packed."""
    try:
        b = torch.cat([t.to_float() for t in bias]) if bias else None
        if any(t.shape[0] % TILE for t in parts):  # tiny models only: fuse the float rows, then pack
            for t in parts:
                plan.note(t.type_name, "Q4", False)
            return linear_spec(pack_q4(torch.cat([t.to_float() for t in parts]), b))
        pieces: list[Q4Packed | Q8LayerPacked | Q6Packed] = []
        for block_run in _block_runs(parts):
            packed = _from_blocks(ops, block_run, plan)
            pieces.extend([packed] if packed is not None else [_packed_in_python(t, plan) for t in block_run])
            _released(block_run)
        runs: list[list[Q4Packed | Q8LayerPacked | Q6Packed]] = []
        for packed in pieces:
            if runs and _can_join(runs[-1][-1], packed):
                runs[-1].append(packed)
            else:
                runs.append([packed])
        joined, n0 = [], 0
        for run in runs:
            n = sum(p.n for p in run)
            run_bias = torch.empty(0) if b is None else b[n0 : n0 + n].contiguous()
            # a piece alone is on huge pages already (a block run joined as it packed): not copied again
            joined.append(replace(run[0], bias=run_bias) if len(run) == 1 else _joined(run, n, run_bias))
            n0 += n
        return linear_spec(*joined)
    finally:
        _released(parts + (bias or []))


def _q8_pieces(tensor: StoredTensor, plan: PackPlan) -> Iterator[Q8Packed]:
    exact = tensor.type_name in Q8_EXACT
    # Q4_0 / Q5_0: q - offset with the same scale (minv = -offset * scale)
    offset = {"Q4_0": 8, "Q5_0": 16}.get(tensor.type_name, 0)
    for chunk in _row_chunks(tensor):
        if exact:
            grid = grid_of(chunk)
            q = torch.from_numpy(grid.q).to(torch.int16) - offset
            yield pack_q8_grid(q, torch.from_numpy(grid.scale))
        else:
            yield pack_q8(chunk.to_float())
    plan.note(tensor.type_name, "Q8", exact)


def _q8_matrix(ops: ModuleType, tensor: StoredTensor, plan: PackPlan) -> Q8Packed:
    try:
        if tensor.type_name in Q8_FROM_BLOCKS and tensor.shape[0] % TILE == 0:
            plan.note(tensor.type_name, "Q8", True)
            return q8_from_blocks(ops, tensor)
        # each chunk's tiles written into the whole outputs as it comes: never all pieces and their join at once
        # (the last chunk's rows padded to a whole tile: a vocabulary of 32,001 runs on the file's grid too)
        n, k = tensor.shape
        padded = -(-n // TILE) * TILE
        qs, scale = huge_pages.zeros((padded * k,), torch.int8), huge_pages.zeros((padded * k // GROUP,), torch.float16)
        at_q = at_s = 0
        for piece in _q8_pieces(tensor, plan):
            qs[at_q : at_q + piece.qs.numel()] = piece.qs
            scale[at_s : at_s + piece.scale.numel()] = piece.scale
            at_q, at_s = at_q + piece.qs.numel(), at_s + piece.scale.numel()
        return Q8Packed(qs, scale, n)
    finally:
        tensor.release()


def _norm(tensor: StoredTensor | None, unit_offset: bool = False) -> torch.Tensor:
    """A norm's float32 factor (1 + w for Gemma's), or an empty tensor for a norm the model does not have."""
    if tensor is None:
        return torch.empty(0)
    values = tensor.to_float().contiguous()
    tensor.release()
    return (1.0 + values).contiguous() if unit_offset else values


LayerLinears = tuple[LinearSpec, LinearSpec, LinearSpec, LinearSpec]  # q/k/v fused, o, gate/up fused, down


@dataclass
class PackedWeights:
    """A model's matrices in the native layouts, packed from the stored tensors alone (no config), so that the
    loader can pack them while it builds the config and tokenizer: the packers release the GIL."""

    embed: Q8Packed
    head: Q8Packed  # the embedding itself when the model ties them
    layers: list[LayerLinears]
    plan: PackPlan


def num_layers_of(tensors: Mapping[str, StoredTensor]) -> int:
    return sum(1 for name in tensors if name.startswith("model.layers.") and name.endswith(".input_layernorm.weight"))


def pack_weights(ops: ModuleType, tensors: Mapping[str, StoredTensor], num_threads: int = 1) -> PackedWeights:
    """Every linear of a Llama-family checkpoint (its Hugging Face names) in its layout, the layers on num_threads
    threads (the packers release the GIL; most of a first load's time is the kernel faulting in fresh pages,
    which threads share out); each stored tensor is released once packed."""
    missing = [n for n in weight_names(num_layers_of(tensors)) if n not in tensors]
    if missing:  # a partial download, one part of a split GGUF: named here, not met as a KeyError while packing
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    plan = PackPlan()
    with ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="sluice-pack") as pool:
        prefixes = [f"model.layers.{i}." for i in range(num_layers_of(tensors))]
        layers = pool.map(lambda prefix: _layer_linears(ops, tensors, prefix, plan), prefixes)
        embed = _q8_matrix(ops, tensors["model.embed_tokens.weight"], plan)
        head = embed if "lm_head.weight" not in tensors else _q8_matrix(ops, tensors["lm_head.weight"], plan)
        return PackedWeights(embed, head, list(layers), plan)


LINEAR_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def weight_names(num_layers: int) -> list[str]:
    """The weights the native step multiplies (lm_head aside: tied where absent)."""
    layers = [f"model.layers.{i}.{n}.weight" for i in range(num_layers) for n in LINEAR_NAMES]
    return ["model.embed_tokens.weight", *layers]


def check_shapes(cfg: Any, tensors: Mapping[str, StoredTensor]) -> None:
    """Each linear's (rows, columns) against the config's sizes: a file whose metadata and tensors disagree is named
    here, not met as a packing error or a failed copy."""
    heads, kv_heads, head_dim = _attn_sizes(cfg)
    hidden, ffn = int(cfg.hidden_size), int(cfg.intermediate_size)
    expected = {"self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv_heads * head_dim, hidden),
                "self_attn.v_proj": (kv_heads * head_dim, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
                "mlp.gate_proj": (ffn, hidden), "mlp.up_proj": (ffn, hidden), "mlp.down_proj": (hidden, ffn)}  # fmt: skip
    wrong = []
    for i in range(int(cfg.num_hidden_layers)):
        for name, shape in expected.items():
            tensor = tensors.get(f"model.layers.{i}.{name}.weight")
            if tensor is not None and tuple(tensor.shape) != shape:
                wrong.append(f"model.layers.{i}.{name}.weight is {tuple(tensor.shape)}, the config makes it {shape}")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensor = tensors.get(name)
        if tensor is not None and tuple(tensor.shape) != (int(cfg.vocab_size), hidden):
            wrong.append(f"{name} is {tuple(tensor.shape)}, the config makes it {(int(cfg.vocab_size), hidden)}")
    if wrong:
        raise ValueError(f"the weights do not match the model's config: {'; '.join(wrong[:3])}"
                         f"{f' (and {len(wrong) - 3} more)' if len(wrong) > 3 else ''}")  # fmt: skip


def _layer_linears(ops: ModuleType, tensors: Mapping[str, StoredTensor], prefix: str, plan: PackPlan) -> LayerLinears:
    def linear(names: list[str]) -> LinearSpec:
        parts = [tensors[prefix + n + ".weight"] for n in names]
        biases = [tensors.get(prefix + n + ".bias") for n in names]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            raise ValueError(f"{prefix}{names}: some of the fused projections have a bias, not all")
        return _linear(ops, parts, biases if biases[0] is not None else None, plan)

    return (
        linear(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]), linear(["self_attn.o_proj"]),
        linear(["mlp.gate_proj", "mlp.up_proj"]), linear(["mlp.down_proj"]),
    )  # fmt: skip


class NativeBackend:
    name = "native"
    is_kv_block_major = True  # a sequence's first blocks lie in a few huge pages, not one per KV head

    def __init__(self, ops: ModuleType, cfg: Any, tensors: Mapping[str, StoredTensor], max_positions: int,
                 precision: str, weights: PackedWeights | None = None) -> None:  # fmt: skip
        heads, kv_heads, head_dim = _attn_sizes(cfg)
        self.num_layers, self.num_kv_heads, self.head_dim = cfg.num_hidden_layers, kv_heads, head_dim
        self.vocab_size = int(cfg.vocab_size)
        self.block_size = 0
        weights = weights or pack_weights(ops, tensors)
        if len(weights.layers) != self.num_layers:
            raise ValueError(f"the checkpoint has {len(weights.layers)} layers, its config {self.num_layers}")
        self.plan = weights.plan
        embed, head = weights.embed, weights.head
        self.is_gemma = cfg.model_type in UNIT_OFFSET_NORMS
        layer_types = list(getattr(cfg, "layer_types", None) or [None] * self.num_layers)
        # the model's rope tables, and a layer type's own when the config gives it one (Gemma 3's sliding layers)
        tables = {kind: rope_tables(cfg, head_dim, max_positions, kind) for kind in sorted(set(layer_types), key=str)}
        cos, sin = tables[layer_types[-1]] if self.is_gemma else rope_tables(cfg, head_dim, max_positions)
        self.impl = ops.NativeLlama(
            cfg.hidden_size, cfg.intermediate_size, heads, kv_heads, head_dim, float(cfg.rms_norm_eps),
            self.vocab_size, embed.qs, embed.scale, head.qs, head.scale,
            _norm(tensors["model.norm.weight"], self.is_gemma), cos.contiguous(), sin.contiguous(),
        )  # fmt: skip
        self.impl.set_precision(precision)
        if self.is_gemma:
            cap = getattr(cfg, "final_logit_softcapping", None) or 0.0
            attn_scale = float(cfg.query_pre_attn_scalar) ** -0.5
            self.impl.set_model_options(float(cfg.hidden_size) ** 0.5, attn_scale, True, float(cap))
        for i in range(self.num_layers):
            prefix = f"model.layers.{i}."
            self._add_layer(tensors, prefix, weights.layers[i])
            layer_cos, layer_sin = tables[layer_types[i]] if self.is_gemma else (cos, sin)
            own = layer_cos is not cos
            self.impl.set_layer_options(
                i, _norm(tensors.get(prefix + "self_attn.q_norm.weight"), self.is_gemma),
                _norm(tensors.get(prefix + "self_attn.k_norm.weight"), self.is_gemma),
                _norm(tensors.get(prefix + "post_attention_layernorm.weight") if self.is_gemma else None, True),
                _norm(tensors.get(prefix + "post_feedforward_layernorm.weight"), True),
                layer_cos.contiguous() if own else torch.empty(0), layer_sin.contiguous() if own else torch.empty(0),
                layer_window(cfg, i) or 0,
            )  # fmt: skip

    def _add_layer(self, tensors: Mapping[str, StoredTensor], prefix: str, linears: LayerLinears) -> None:
        # Llama's post_attention_layernorm is the norm before the MLP; Gemma's is the one after attention
        before_mlp = "pre_feedforward_layernorm" if self.is_gemma else "post_attention_layernorm"
        self.impl.add_layer(
            _norm(tensors[prefix + "input_layernorm.weight"], self.is_gemma),
            _norm(tensors[prefix + before_mlp + ".weight"], self.is_gemma), *linears,
        )  # fmt: skip

    def bind_kv_caches(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """The runner's per-layer caches, [num_blocks, KVH, block_size, head_dim], float32 or bfloat16."""
        self.impl.set_kv_caches(k, v)
        self.block_size = k[0].shape[2]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return self.impl.logits(hidden.float().contiguous())

    def forward(self, batch: StepBatch) -> StepHidden:
        """The step's tokens in chunk order. Every token attends to positions 0 .. its own of its sequence, read in
        place through its block table."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        row_seq: list[int] = []
        chunk_rows: list[range] = []
        tables: list[int] = []  # [chunks, width] flat, each row padded with block 0
        bs = self.block_size
        width = max(len(c.block_table) for c in batch.chunks)
        for i, c in enumerate(batch.chunks):
            end = c.start_pos + c.num_tokens
            chunk_rows.append(range(len(input_ids), len(input_ids) + c.num_tokens))
            input_ids += c.token_ids
            positions += range(c.start_pos, end)
            slots += [c.block_table[p // bs] * bs + p % bs for p in range(c.start_pos, end)]
            row_seq += [i] * c.num_tokens
            tables += c.block_table
            tables += [0] * (width - len(c.block_table))
        hidden = self.run_tokens(
            torch.tensor(input_ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            torch.tensor(slots, dtype=torch.int64),
            torch.tensor(row_seq, dtype=torch.int32),
            torch.tensor(tables, dtype=torch.int32).view(len(batch.chunks), width),
        )
        return StepHidden(hidden, chunk_rows)

    def run_tokens(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        slots: torch.Tensor,  # [T] int64 cache slot of each token's K/V
        row_seq: torch.Tensor,  # [T] int32 row of block_tables of each token's sequence
        block_tables: torch.Tensor,  # [S, max_blocks] int32
    ) -> torch.Tensor:
        """[T, hidden] float32 hidden states before the final norm (the C++ step, for tests and benches)."""
        return self.impl.forward(input_ids, positions, slots, row_seq, block_tables)
