"""Verification: the sampling parameters of every position of a verification query, and acceptance.

Row j of a query [last token, d1 .. dk] samples the token after d1 .. dj exactly as plain decoding would once
those drafts had been generated: the same penalties over the longer output, min_tokens' bans by the longer
count, the grammar past the drafts, and a seeded row's noise from (seed, num_output_tokens + j). Acceptance keeps
the drafts up to the first that differs from its row's sample and then that sample (or, all accepted, row k's).

This is the lossless rule for deterministic drafts: a draft x is kept with probability p(x), and the token
emitted on its rejection is distributed as p with x removed and renormalised. It is also plain decoding's
output itself: greedy rows give argmax, and seeded rows draw the same noise, so a seeded request returns the
same tokens with speculation on or off.
"""

from __future__ import annotations

from dataclasses import replace

from engine.batch import SampledToken, SamplingRow


def verify_rows(base: SamplingRow, drafts: list[int], min_tokens: int) -> list[SamplingRow]:
    """[base] and one row per draft: row j as base would be after drafts[:j] (base: the sequence's row now)."""
    rows = [base]
    for j in range(1, len(drafts) + 1):
        num_output = base.num_output_tokens + j
        rows.append(
            replace(
                base,
                num_output_tokens=num_output,
                # the penalties read the output; otherwise the sampler never looks at it
                output_token_ids=base.output_token_ids + drafts[:j] if base.has_penalties else base.output_token_ids,
                banned_token_ids=base.banned_token_ids if num_output < min_tokens else (),
                matcher_lookahead=tuple(drafts[:j]) if base.matcher is not None else (),
            )
        )
    return rows


def num_accepted(drafts: list[int], sampled: list[SampledToken]) -> int:
    """How many leading drafts equal what their rows sampled (sampled has one more entry than drafts)."""
    n = 0
    for draft, token in zip(drafts, sampled):
        if draft != token.token_id:
            break
        n += 1
    return n
