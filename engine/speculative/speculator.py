"""Which tokens a decoding sequence guesses this step, if any: the proposers, the policy and the counters.

The scheduler asks `propose(seq, num_running)` for each decoding sequence; the engine reports what was accepted
(`on_verified`) and what finished (`on_finished`). Pure Python on the event-loop thread, no tensors.

Policy ("auto"): a verification row costs little while the step is bound by reading the weights (few rows) and
as much as any row once it is bound by arithmetic (many rows). So a sequence speculates only while the running
batch is small (max_running) and while its own acceptance average earns its extra rows; a sequence whose drafts
keep failing stops proposing and probes again now and then. "on" proposes whenever a proposer has something
(tests, bench); "off" never.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.speculative.prompt_lookup import NgramIndex
from engine.speculative.stats import SpeculationStats
from engine.speculative.suffix_index import RecentOutputs

MODES = ("auto", "on", "off")
# "auto": speculate only while at most this many sequences run (measured, see the README's speculation table).
AUTO_MAX_RUNNING = 4
# A sequence's accepted-per-drafted average: below LOW it stops proposing (probing every PROBE_INTERVAL steps),
# below HIGH its drafts are cut to SHORT_DRAFTS tokens.
EMA_WEIGHT = 0.3
LOW_ACCEPTANCE = 0.15
HIGH_ACCEPTANCE = 0.4
SHORT_DRAFTS = 2
PROBE_INTERVAL = 8


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    mode: str = "off"
    num_drafts: int = 5  # k: most tokens guessed per sequence per step
    min_ngram: int = 2
    max_ngram: int = 4
    recent_tokens: int = 65536  # the bound of the index over recent outputs

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"speculative must be one of {MODES}, got {self.mode!r}")
        if not 1 <= self.num_drafts <= 16:
            raise ValueError(f"speculative_k must be in [1, 16], got {self.num_drafts}")
        if not 1 <= self.min_ngram <= self.max_ngram <= 8:
            raise ValueError(
                f"speculative n-gram sizes need 1 <= min <= max <= 8, got {self.min_ngram} and {self.max_ngram}"
            )
        if self.recent_tokens < 0:
            raise ValueError(f"speculative_recent_tokens must be >= 0, got {self.recent_tokens}")


class SeqSpeculation:
    """One sequence's speculation state: its n-gram index, acceptance average and the proposer of its drafts."""

    __slots__ = ("index", "acceptance", "num_skipped", "proposer")

    def __init__(self, config: SpeculativeConfig) -> None:
        self.index = NgramIndex(config.min_ngram, config.max_ngram)
        self.acceptance = 1.0  # optimistic start: the first drafts are tried in full
        self.num_skipped = 0
        self.proposer = ""


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.recent = RecentOutputs(config.min_ngram, config.max_ngram, config.recent_tokens)
        self.stats = SpeculationStats()

    @property
    def is_enabled(self) -> bool:
        return self.config.mode != "off"

    def propose(self, seq, num_running: int) -> list[int]:
        """Draft tokens for a decoding sequence this step ([] for none). seq is an engine Sequence."""
        config = self.config
        if not seq.params.speculative or seq.num_forks:
            return []
        # Every accepted draft plus the token sampled after them must fit max_tokens and the context.
        max_drafts = min(
            config.num_drafts,
            seq.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
        )
        if max_drafts <= 0:
            return []
        state: SeqSpeculation | None = seq.speculation
        if state is None:
            state = seq.speculation = SeqSpeculation(config)
        if config.mode == "auto":
            if num_running > AUTO_MAX_RUNNING:
                return []
            if state.acceptance < LOW_ACCEPTANCE:
                state.num_skipped += 1
                if state.num_skipped < PROBE_INTERVAL:
                    return []
                state.num_skipped = 0
                max_drafts = 1
            elif state.acceptance < HIGH_ACCEPTANCE:
                max_drafts = min(max_drafts, SHORT_DRAFTS)
        num_tokens = seq.num_tokens
        drafts = state.index.propose(seq, num_tokens, max_drafts)
        state.proposer = "prompt"
        if not drafts and self.recent.num_tokens:
            drafts = self.recent.propose(seq.token_slice(max(0, num_tokens - config.max_ngram), num_tokens), max_drafts)
            state.proposer = "recent"
        if drafts and seq.matcher is not None:
            drafts = drafts[: seq.matcher.validate_tokens(drafts)]  # a draft the grammar forbids is rejected here
        return drafts

    def on_verified(self, seq, num_drafts: int, num_accepted: int) -> None:
        state: SeqSpeculation = seq.speculation
        state.acceptance += EMA_WEIGHT * (num_accepted / num_drafts - state.acceptance)
        self.stats.record(state.proposer, num_drafts, num_accepted)

    def on_finished(self, output_token_ids: list[int]) -> None:
        if self.is_enabled and self.config.recent_tokens:
            self.recent.add(output_token_ids)
