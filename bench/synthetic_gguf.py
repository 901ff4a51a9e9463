"""Synthetic GGUF files written locally with the gguf package's writer (tests, and the 1B-class file of the
bench: `python -m bench.synthetic_gguf OUT.gguf`): a Llama of any size with SmolLM2's tokenizer (copied
from the packaged GGUF's metadata) and each tensor in the quant type asked for. The gguf package quantises the
legacy types (Q4_0 ... Q5_1) and the float ones; it has no K-quant encoder, so K-quant (and, for speed, Q8_0)
tensors are random valid blocks (small random float16 scales, random integer fields): what a test of their layout
needs."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from engine.checkpoint.source import default_gguf_path

# byte offsets of the float16 scales in one block of each K-quant type, and their magnitude: weights stay O(0.1)
RANDOM_BLOCK_SCALES = {"Q4_K": ((0, 2), 4e-4), "Q5_K": ((0, 2), 2e-4), "Q6_K": ((208,), 2e-5), "Q8_0": ((0,), 1e-3)}
LAYER_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def random_blocks(rng: np.random.Generator, type_name: str, n: int, k: int) -> np.ndarray:
    """uint8 [n, k / block * bytes]: random weights of shape [n, k] in the given type."""
    ggml_type = GGMLQuantizationType[type_name]
    if type_name in RANDOM_BLOCK_SCALES:  # fast for large files too
        block, block_bytes = GGML_QUANT_SIZES[ggml_type]
        raw = rng.integers(0, 256, size=(n * k // block, block_bytes), dtype=np.uint8)
        offsets, magnitude = RANDOM_BLOCK_SCALES[type_name]
        for offset in offsets:
            scales = np.abs(rng.normal(0, magnitude, size=(raw.shape[0], 1))).astype(np.float16)
            raw[:, offset : offset + 2] = scales.view(np.uint8)
        return raw.reshape(n, -1)
    weights = rng.normal(0, 0.05, size=(n, k)).astype(np.float32)
    return quantize(weights, ggml_type)


@lru_cache(maxsize=1)
def smollm2_tokenizer() -> dict:
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, _ = read_gguf_metadata(str(default_gguf_path()), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    return {k: v for k, v in metadata.items() if k.startswith("tokenizer.")}


def write_llama_gguf(
    path: Path,
    types: dict[str, str],  # role ("attn_q", ..., "token_embd", "output") -> type; "layers" sets every layer role
    hidden: int = 256,
    intermediate: int = 512,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tied: bool = False,
    seed: int = 0,
    with_merges: bool = True,  # False: a file whose tokenizer lacks its merges (a broken conversion)
    rope_factors: np.ndarray | None = None,  # llama.cpp's rope_freqs.weight (Llama 3.1+): one per rotary pair
    extra_tokens: int = 0,  # added tokens past SmolLM2's 49,152 (a fine-tune's pad token makes a vocabulary odd)
) -> Path:
    rng = np.random.default_rng(seed)
    tok = smollm2_tokenizer()
    tok["tokenizer.ggml.tokens"] = [*tok["tokenizer.ggml.tokens"], *(f"<|extra_{i}|>" for i in range(extra_tokens))]
    tok["tokenizer.ggml.token_type"] = [*tok["tokenizer.ggml.token_type"], *([4] * extra_tokens)]  # user-defined
    vocab = len(tok["tokenizer.ggml.tokens"])
    head_dim = hidden // num_heads
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(num_layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model(tok["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(tok.get("tokenizer.ggml.pre", "default"))
    writer.add_token_list(tok["tokenizer.ggml.tokens"])
    if with_merges:
        writer.add_token_merges(tok["tokenizer.ggml.merges"])
    writer.add_token_types(tok["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(tok["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(tok["tokenizer.ggml.eos_token_id"])
    writer.add_chat_template(tok["tokenizer.chat_template"])

    def add(name: str, role: str, n: int, k: int) -> None:
        type_name = types.get(role) or types.get("layers" if role in LAYER_ROLES else role, "F32")
        if type_name == "F32":
            writer.add_tensor(name, rng.normal(0, 0.05, size=(n, k)).astype(np.float32))
        else:
            ggml_type = GGMLQuantizationType[type_name]
            writer.add_tensor(name, random_blocks(rng, type_name, n, k), raw_dtype=ggml_type)

    def add_norm(name: str, size: int) -> None:
        writer.add_tensor(name, (1 + rng.normal(0, 0.1, size=size)).astype(np.float32))

    add("token_embd.weight", "token_embd", vocab, hidden)
    for i in range(num_layers):
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        add_norm(f"blk.{i}.attn_norm.weight", hidden)
        for role, n, k in (("attn_q", q, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                           ("attn_output", hidden, q), ("ffn_gate", intermediate, hidden),
                           ("ffn_up", intermediate, hidden), ("ffn_down", hidden, intermediate)):  # fmt: skip
            add(f"blk.{i}.{role}.weight", role, n, k)
        add_norm(f"blk.{i}.ffn_norm.weight", hidden)
    add_norm("output_norm.weight", hidden)
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", rope_factors.astype(np.float32))
    if not tied:
        add("output.weight", "output", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_float_copy(source: Path, path: Path) -> Path:
    """The same model with every tensor float32: the file's own dequantised values and the same metadata (llama.cpp's
    float reference for a like-for-like KL divergence of its quantised run)."""
    from gguf import GGUFReader, GGUFValueType
    from gguf.quants import dequantize

    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(path), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type)
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, values.reshape([int(d) for d in reversed(tensor.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# A 1B-class Llama laid out like a downloaded Q4_K_M file (llama.cpp's mix: Q6_K for attn_v and ffn_down)
ONE_B_Q4_K_M = dict(
    types={"layers": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q8_0"},
    hidden=2048, intermediate=8192, num_layers=16, num_heads=32, num_kv_heads=8, tied=True,
)  # fmt: skip


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="write the synthetic 1B-class Q4_K_M Llama GGUF (random weights)")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    path = write_llama_gguf(args.out, **ONE_B_Q4_K_M)
    print(f"wrote {path} ({path.stat().st_size >> 20} MiB)")


if __name__ == "__main__":
    main()
