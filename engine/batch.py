"""What one engine step hands to the model runner, and what it gets back.

The scheduler side builds a StepBatch from plain Python data on the event-loop thread; the runner reads it in
the worker thread. Nothing in a StepBatch is mutated while a forward pass runs: aborts that arrive meanwhile
are applied after the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.grammar_clock import GrammarClock


@dataclass(slots=True)
class SamplingRow:
    """Sampling inputs for one sequence that samples a token this step."""

    temperature: float
    top_k: int  # <= 0: off
    top_p: float
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int | None  # seeded rows draw noise from (seed, num_output_tokens) only: batch-independent
    num_logprobs: int | None  # None: no logprobs; N: the sampled token's logprob plus the top N
    num_output_tokens: int  # output tokens generated so far
    prompt_token_ids: list[int]  # read only; used by repetition_penalty
    output_token_ids: list[int]  # read only; used by the penalties
    banned_token_ids: tuple[int, ...] = ()  # EOS / stop ids while fewer than min_tokens were generated
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit (read only)
    # An llguidance LLMatcher at this row's next token, or None. Read only here (its mask is computed from
    # it); the event-loop thread advances it after the step.
    matcher: Any = None
    # Draft tokens the matcher must take first (a verification row past drafts): consumed for the mask, then
    # rolled back, so the matcher is as it was when the step ends.
    matcher_lookahead: tuple[int, ...] = ()
    grammar_clock: GrammarClock | None = None  # the sequence's, with the matcher: the mask's time is added to it

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass(slots=True)
class PromptScoring:
    """Prompt logprobs wanted from a chunk: row i (position start_pos + i) scores the prompt token after it."""

    target_ids: list[int]  # the prompt tokens at positions start_pos + 1 ..., one per leading row of the chunk
    num_top: int  # the top num_top alternatives at each of those rows too


@dataclass(slots=True)
class SeqChunk:
    """One sequence's share of a step: feed token_ids at positions start_pos .. start_pos + len - 1."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]  # physical KV blocks covering positions [0, start_pos + len(token_ids))
    sampling: SamplingRow | None  # None: a prefill chunk that does not reach the end of the prompt
    prompt_scoring: PromptScoring | None = None
    # A verification query (token_ids = the last token and k drafts): every row samples, row j with these
    # parameters (the sequence as if drafts[:j] had been appended); sampling is then verify_rows[0].
    verify_rows: list[SamplingRow] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class StepBatch:
    chunks: list[SeqChunk] = field(default_factory=list)


@dataclass(slots=True)
class StepOutput:
    """What a forward pass yields: the sampled tokens, and the prompt logprobs that chunks asked for."""

    # In chunk order: one per chunk with sampling set, or one per row of a chunk with verify_rows.
    sampled: list[SampledToken]
    prompt_logprobs: dict[int, list[SampledToken]] = field(default_factory=dict)  # seq_id -> one per target id


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # log-probability of token_id under the unmodified model distribution
    top_logprobs: list[tuple[int, float]] | None = None  # (token_id, logprob), most likely first
