"""n > 1: one prompt, n choices. The prompt's leading full KV blocks are computed once, by a fork parent, and
then shared by reference count among the n choices; each choice computes the rest of the prompt itself.

Why the rest is recomputed rather than copied: the last block of a prompt is usually partly filled, and each
choice writes its own tokens into the slots after the prompt, so n choices cannot share that block. Copying
it would need a block-copy instruction in the runner; recomputing it costs each choice at most block_size
prompt tokens, run as one small prefill chunk beside the others in the step after the fork, and leaves the
runner and its attention paths untouched. That step also samples each choice's first token (seed + i), so
no row is sampled twice and every choice is an ordinary sequence from then on: its own detokenizer, stop
strings, finish reason, preemption and blocks.
"""

from __future__ import annotations

import dataclasses

from engine.sampling_params import SamplingParams


def fork_point(num_prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens the fork parent computes: the full blocks, less the block holding the last prompt token
    (each choice needs at least one prompt token of its own to compute, whose logits give its first token).
    0 when the prompt fits in one block: then the n choices simply compute their short prompts each."""
    return (num_prompt_tokens - 1) // block_size * block_size


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice i of a request samples with seed + i, so that a seeded request is reproducible choice by choice
    (wrapped within the 64 signed bits a seed takes: 2^63 - 1 and n = 2 failed the check inside the engine loop)."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index + 2**63) % 2**64 - 2**63)
