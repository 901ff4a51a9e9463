"""GGUF tensor names -> the Hugging Face parameter names our model code loads, one table per architecture.

A row maps a name of the file ("blk.{i}." for every layer) to ours. An architecture's entry also says how its
tensors differ from the Hugging Face ones beyond their names: Llama's converter interleaves the rotary halves of
q and k (undone here by permuting rows, exact in any quant type). A new architecture is a new entry here plus its
config keys in gguf_config.py; `unsupported` names what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYER = "blk.{i}."

# The decoder layer of the Llama family as llama.cpp names it.
LLAMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
LLAMA_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# llama.cpp's rotary frequency factors (one divisor per rotary pair: Llama 3.1+'s long-context scaling, which the
# converter writes as this tensor and not as metadata): read into the config, not a weight
ROPE_FACTORS = "rope_freqs.weight"


@dataclass(frozen=True)
class ArchTensors:
    globals: dict[str, str]  # whole-model tensors
    layer: dict[str, str]  # per-layer tensors, without the "blk.{i}." / "model.layers.{i}." prefixes
    permuted_qk: bool = False  # rows of attn_q / attn_k interleaved by llama.cpp's converter (Llama, Mistral)
    norm_offset: float = 0.0  # added to every *norm.weight on load (Gemma's files store 1 + w)

    def hf_name(self, gguf_name: str) -> str | None:
        if gguf_name in self.globals:
            return self.globals[gguf_name]
        if not gguf_name.startswith("blk."):
            return None
        index, _, rest = gguf_name[4:].partition(".")
        if not index.isdigit() or rest not in self.layer:
            return None
        return f"model.layers.{index}.{self.layer[rest]}"


QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
# Gemma 3: the norm before the MLP is ffn_norm (pre_feedforward), and each sublayer has a post-norm
GEMMA3_LAYER = {
    **LLAMA_LAYER, **QK_NORMS,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}  # fmt: skip

ARCHITECTURES: dict[str, ArchTensors] = {
    "llama": ArchTensors(LLAMA_GLOBAL, LLAMA_LAYER, permuted_qk=True),
    "mistral": ArchTensors(LLAMA_GLOBAL, LLAMA_LAYER, permuted_qk=True),
    "qwen2": ArchTensors(LLAMA_GLOBAL, LLAMA_LAYER),
    "qwen3": ArchTensors(LLAMA_GLOBAL, {**LLAMA_LAYER, **QK_NORMS}),
    "gemma3": ArchTensors(LLAMA_GLOBAL, GEMMA3_LAYER, norm_offset=-1.0),  # llama.cpp stores 1 + w
}


def arch_tensors(architecture: str) -> ArchTensors:
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {architecture!r}: Sluice reads {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[architecture]
