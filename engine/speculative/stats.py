"""Counters of speculation, by proposer: what /metrics and bench report. Only the event-loop thread updates them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

PROPOSERS = ("prompt", "recent")  # prompt lookup in the sequence itself; the index of recent outputs


@dataclass(slots=True)
class ProposerCounts:
    num_steps: int = 0  # verification steps whose drafts came from this proposer
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # of which accepted
    num_emitted_tokens: int = 0  # tokens those steps emitted: accepted drafts plus the one sampled after them

    @property
    def tokens_per_step(self) -> float:
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def summed_counts(*reports: Mapping[str, ProposerCounts]) -> dict[str, ProposerCounts]:
    """Several engines' counters by proposer, added up (a front's replicas)."""
    total: dict[str, ProposerCounts] = {}
    for report in reports:
        for proposer, counts in report.items():
            into = total.setdefault(proposer, ProposerCounts())
            for f in fields(ProposerCounts):
                setattr(into, f.name, getattr(into, f.name) + getattr(counts, f.name))
    return total


@dataclass(slots=True)
class SpeculationStats:
    by_proposer: dict[str, ProposerCounts] = field(default_factory=lambda: {p: ProposerCounts() for p in PROPOSERS})
    num_decode_steps: int = 0  # decode chunks without drafts (a sequence that did not speculate this step)

    def record(self, proposer: str, num_drafts: int, num_accepted: int) -> None:
        counts = self.by_proposer[proposer]
        counts.num_steps += 1
        counts.num_draft_tokens += num_drafts
        counts.num_accepted_tokens += num_accepted
        counts.num_emitted_tokens += num_accepted + 1

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {
            name: {
                "steps": c.num_steps,
                "draft_tokens": c.num_draft_tokens,
                "accepted_tokens": c.num_accepted_tokens,
                "emitted_tokens": c.num_emitted_tokens,
                "tokens_per_step": round(c.tokens_per_step, 3),
                "acceptance_rate": round(c.acceptance_rate, 3),
            }
            for name, c in self.by_proposer.items()
        }
