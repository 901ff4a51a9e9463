"""Which tokens a decoding sequence guesses this step, if any: the proposers, the policy and the counters.

The scheduler asks `propose(seq, num_running)` for each decoding sequence; the engine reports what was accepted
(`on_verified`) and what finished (`on_finished`). Pure Python on the event-loop thread, no tensors.

Policy ("auto"): each draft must earn its row. A sequence keeps an estimate of the chance that its next draft
is accepted (alpha, per draft, from its own verifications; a new one starts from the average of all), so its
j-th draft is worth alpha**j tokens; the step-cost model (step_cost.py, learnt from the steps' own timings) says
what a row must yield to pay in a step of this size. Drafts are proposed while they earn that with a margin,
so where rows cost nearly as much as a step (many sequences running, or kernels bound by arithmetic) "auto"
proposes nothing; a sequence that proposes nothing tries one draft every PROBE_INTERVAL steps to learn. "on"
proposes whenever a proposer has something (tests, bench); "off" never.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.speculative.prompt_lookup import NgramIndex
from engine.speculative.stats import SpeculationStats
from engine.speculative.step_cost import StepCostModel
from engine.speculative.suffix_index import RecentOutputs

MODES = ("auto", "on", "off")
EMA_WEIGHT = 0.3  # of a sequence's latest verification in its acceptance estimate
PRIOR_WEIGHT = 0.05  # of any verification in the estimate new sequences start from
PRIOR_ACCEPTANCE = 0.5
MARGIN = 1.15  # a draft must be worth this many times its row's cost
PROBE_INTERVAL = 32  # steps without drafts before a sequence tries one (at most 1/32 of a row's cost lost)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    mode: str = "off"
    num_drafts: int = 8  # k: most tokens guessed per sequence per step
    min_ngram: int = 2
    max_ngram: int = 4
    recent_tokens: int = 65536  # the bound of the index over recent outputs

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"speculative must be one of {MODES}, got {self.mode!r}")
        names = ("speculative_k", "speculative_ngram_min", "speculative_ngram_max", "speculative_recent_tokens")
        values = (self.num_drafts, self.min_ngram, self.max_ngram, self.recent_tokens)
        for name, value in zip(names, values):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not 1 <= self.num_drafts <= 16:
            raise ValueError(f"speculative_k must be in [1, 16], got {self.num_drafts}")
        if not 1 <= self.min_ngram <= self.max_ngram <= 8:
            raise ValueError(
                f"speculative n-gram sizes need 1 <= min <= max <= 8, got {self.min_ngram} and {self.max_ngram}"
            )
        if self.recent_tokens < 0:
            raise ValueError(f"speculative_recent_tokens must be >= 0, got {self.recent_tokens}")


class SeqSpeculation:
    """One sequence's speculation state: its n-gram index, acceptance estimate and the proposer of its drafts."""

    __slots__ = ("index", "acceptance", "num_skipped", "proposer")

    def __init__(self, config: SpeculativeConfig, acceptance: float) -> None:
        self.index = NgramIndex(config.min_ngram, config.max_ngram)
        self.acceptance = acceptance  # the chance that its next draft is accepted
        self.num_skipped = 0
        self.proposer = ""


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.recent = RecentOutputs(config.min_ngram, config.max_ngram, config.recent_tokens)
        self.stats = SpeculationStats()
        self.cost = StepCostModel()
        self.prior_acceptance = PRIOR_ACCEPTANCE

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
            state = seq.speculation = SeqSpeculation(config, self.prior_acceptance)
        is_probe = False
        if config.mode == "auto":
            cost = self.cost.break_even(num_running, num_running) * MARGIN
            if cost >= 1:  # a row costs a token or more here: not even a sure draft pays
                return []
            max_drafts = self._worth(state.acceptance, max_drafts, cost)
            if not max_drafts:
                if state.num_skipped < PROBE_INTERVAL:
                    state.num_skipped += 1
                    return []
                max_drafts, is_probe = 1, True
        num_tokens = seq.num_tokens
        drafts = state.index.propose(seq, num_tokens, max_drafts)
        state.proposer = "prompt"
        if not drafts and self.recent.num_tokens:
            drafts = self.recent.propose(seq.token_slice(max(0, num_tokens - config.max_ngram), num_tokens), max_drafts)
            state.proposer = "recent"
        if drafts and seq.matcher is not None:
            drafts = drafts[: seq.matcher.validate_tokens(drafts)]  # a draft the grammar forbids is rejected here
        if drafts and is_probe:
            state.num_skipped = 0
        return drafts

    @staticmethod
    def _worth(acceptance: float, max_drafts: int, cost: float) -> int:
        """How many drafts pay when a row must yield `cost` tokens: the j-th is worth acceptance**j tokens."""
        n, worth = 0, acceptance
        while n < max_drafts and worth > cost:
            n += 1
            worth *= acceptance
        return n

    def on_step(self, num_rows: int, seconds: float) -> None:
        """A forward pass of num_rows rows took this long (it feeds the step-cost model)."""
        self.cost.observe(num_rows, seconds)

    def on_verified(self, seq, num_drafts: int, num_accepted: int) -> None:
        state: SeqSpeculation = seq.speculation
        # Drafts are tried in order until one fails: num_accepted successes in this many trials.
        num_trials = num_accepted + (num_accepted < num_drafts)
        observed = num_accepted / num_trials
        state.acceptance += EMA_WEIGHT * (observed - state.acceptance)
        self.prior_acceptance += PRIOR_WEIGHT * (observed - self.prior_acceptance)
        self.stats.record(state.proposer, num_drafts, num_accepted)

    def on_finished(self, output_token_ids: list[int]) -> None:
        if self.is_enabled and self.config.recent_tokens:
            self.recent.add(output_token_ids)
