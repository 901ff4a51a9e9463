"""A bounded index over recent requests' outputs (SuffixDecoding's idea, in its simplest form): agents, code
edits and repeated questions produce the same token runs across requests, so when a sequence's own prompt and
output offer no match, the run that followed its last n tokens in a recent output is proposed.

Outputs are kept whole, oldest evicted first, up to max_tokens tokens in all; each n-gram (n in [min_n, max_n])
maps to the latest (output, position) where it ended. Only the event-loop thread calls it.
"""

from __future__ import annotations

from collections import deque


class RecentOutputs:
    def __init__(self, min_n: int, max_n: int, max_tokens: int) -> None:
        self.min_n, self.max_n, self.max_tokens = min_n, max_n, max_tokens
        self._outputs: deque[tuple[int, tuple[int, ...]]] = deque()  # (output id, its tokens), oldest first
        self._by_id: dict[int, tuple[int, ...]] = {}
        self._ends: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (output id, position after it)
        self._num_tokens = 0
        self._next_id = 0

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def add(self, tokens: list[int]) -> None:
        """Remember one finished output (too short or longer than the whole bound: ignored)."""
        if len(tokens) <= self.min_n or len(tokens) > self.max_tokens:
            return
        output_id, kept = self._next_id, tuple(tokens)
        self._next_id += 1
        while self._num_tokens + len(kept) > self.max_tokens:
            self._evict()
        self._outputs.append((output_id, kept))
        self._by_id[output_id] = kept
        self._num_tokens += len(kept)
        for n in range(self.min_n, self.max_n + 1):
            for end in range(n, len(kept)):  # an n-gram ending the output has nothing to propose
                self._ends[kept[end - n : end]] = (output_id, end)

    def propose(self, suffix: list[int], max_drafts: int) -> list[int]:
        """Up to max_drafts tokens that followed the longest matching tail of suffix (its last max_n tokens or
        fewer) in a recent output; [] when none matches."""
        for n in range(min(self.max_n, len(suffix)), self.min_n - 1, -1):
            hit = self._ends.get(tuple(suffix[len(suffix) - n :]))
            if hit is not None:
                output_id, end = hit
                return list(self._by_id[output_id][end : end + max_drafts])
        return []

    def _evict(self) -> None:
        output_id, kept = self._outputs.popleft()
        del self._by_id[output_id]
        self._num_tokens -= len(kept)
        for n in range(self.min_n, self.max_n + 1):
            for end in range(n, len(kept)):
                key = kept[end - n : end]
                if self._ends.get(key, (None,))[0] == output_id:
                    del self._ends[key]
