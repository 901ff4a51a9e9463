"""Tiny random models built locally (no hub): a trained byte-level BPE tokenizer plus Llama / Qwen 3 / Gemma 3 /
GPT-2 configs."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Streaming tokens over server-sent events is fun.",
    "Continuous batching lets many requests share one forward pass.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "日本語のテキストと中文文本和한국어 텍스트.",
    "Emoji: 😀 🚀 🎉 👍🏽 ❤️ and accents: café, naïve, Zürich.",
    "def add(a, b):\n    return a + b\n",
    "Numbers 0123456789 and punctuation: ,.;:!?()[]{}<>",
] * 4

# With Qwen 3's switch: chat_template_kwargs {"enable_thinking": false} opens the answer with an empty thought.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen 3's thought markers: added tokens that are not special (151667 / 151668 in the real vocabulary), so that
# output text shows them.
THINK_TOKENS = ["<think>", "</think>"]


def build_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_llama(path: Path, seed: int = 0, tokenizer: PreTrainedTokenizerFast | None = None, **overrides) -> Path:
    tokenizer = tokenizer or build_tokenizer()
    defaults = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.1,  # spreads the logits: greedy parity tests should not hinge on near-ties
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config = LlamaConfig(**{**defaults, **overrides})
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_tiny_gpt2(path: Path, seed: int = 0, **overrides) -> Path:
    tokenizer = build_tokenizer()
    defaults = dict(
        vocab_size=len(tokenizer),
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=512,
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config = GPT2Config(**{**defaults, **overrides})
    torch.manual_seed(seed)
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _randomise_norms(model: torch.nn.Module, seed: int) -> None:
    """Norm weights start as ones (Qwen) or zeros (Gemma's 1 + w): spread them so that a norm read wrongly shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


def build_qwen3_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tokenizer with Qwen 3's <think> and </think> as single tokens (the last two ids: 384 in all)."""
    tokenizer = build_tokenizer(vocab_size=384 - len(THINK_TOKENS))
    tokenizer.add_tokens(THINK_TOKENS)
    return tokenizer


def save_tiny_qwen3(path: Path, seed: int = 0, **overrides) -> Path:
    """Qwen 3: Llama plus an RMSNorm over each query and key head."""
    tokenizer = build_qwen3_tokenizer()
    defaults = dict(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    config = Qwen3Config(**{**defaults, **overrides})
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    _randomise_norms(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


GEMMA3_WINDOW = 8  # small, so that short prompts already slide


def save_tiny_gemma3(path: Path, seed: int = 0, **overrides) -> Path:
    """Gemma 3 with every feature of the family small enough to see: sliding layers (window 8) between global ones,
    each kind with its own rope base (the global one linearly scaled), q/k norms, sandwich norms, GeGLU, scaled
    embeddings, query_pre_attn_scalar different from head_dim, tied embeddings."""
    tokenizer = build_tokenizer()
    defaults = dict(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=GEMMA3_WINDOW, query_pre_attn_scalar=24,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        },
        tie_word_embeddings=True, initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    config = Gemma3TextConfig(**{**defaults, **overrides})
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config)
    _randomise_norms(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
