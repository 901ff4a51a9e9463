"""Prompt lookup: the tokens that followed the latest earlier occurrence of a sequence's last n tokens, in its
own prompt and output, are proposed as its next ones (no draft model).

Each sequence keeps an n-gram index of its own tokens (n-gram -> the position just after its latest
occurrence), extended lazily by the tokens appended since the last lookup: O(new tokens) per step, and one pass
over the prompt the first time. Pure Python; only the event-loop thread calls it.
"""

from __future__ import annotations

from typing import Protocol


class TokenSource(Protocol):
    def token_slice(self, start: int, end: int) -> list[int]: ...


class NgramIndex:
    """n-grams of one token sequence for n in [min_n, max_n], each mapped to where its latest occurrence ends."""

    __slots__ = ("min_n", "max_n", "_ends", "num_indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]
        self.num_indexed = 0  # n-grams ending before this position are in the index

    def extend(self, tokens: TokenSource, end: int) -> None:
        """Index the n-grams that end at positions num_indexed .. end - 1 (exclusive ends: tokens[e - n : e])."""
        for e in range(max(self.num_indexed, self.min_n), end + 1):
            for n, ends in zip(range(self.min_n, self.max_n + 1), self._ends):
                if e >= n:
                    ends[tuple(tokens.token_slice(e - n, e))] = e
        self.num_indexed = max(self.num_indexed, end + 1)

    def propose(self, tokens: TokenSource, num_tokens: int, max_drafts: int) -> list[int]:
        """Up to max_drafts tokens following the latest earlier occurrence of the longest matching suffix of
        tokens [0, num_tokens); [] when none of its last min_n .. max_n tokens occurred before."""
        # The suffix itself (ending at num_tokens) must not match itself: index up to num_tokens - 1 only.
        self.extend(tokens, num_tokens - 1)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            end = self._ends[n - self.min_n].get(tuple(tokens.token_slice(num_tokens - n, num_tokens)))
            if end is not None:
                return tokens.token_slice(end, min(end + max_drafts, num_tokens))
        return []
