"""The grammar's share of sampling: tokens a row's matcher does not allow get -inf, for the whole batch at once.

Runs in the worker thread, after the forward pass, reading the matchers (the event-loop thread advances them
only after the step). llguidance fills every constrained row's bitmask in one call that drops the GIL and
works in its own threads; one numpy unpack and one masked_fill_ apply them. Measured on this 2-core CPU with
SmolLM2's 49152-token vocabulary and a JSON schema: filling 32 rows' masks takes 0.15-0.3 ms, applying them
about 1 ms. Filling while the forward pass runs would hide the first part, but both cores are busy with the
forward pass then, so it would gain nothing here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.batch import SamplingRow


class GrammarMasker:
    def __init__(self, num_threads: int | None = None) -> None:
        from llguidance import LLExecutor

        self._executor = LLExecutor(num_threads)
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)

    def apply_(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        """In place on [N, V] logits: every row with a matcher keeps only the tokens its grammar allows next."""
        constrained = [i for i, row in enumerate(rows) if row.matcher is not None]
        if not constrained:
            return
        num_rows, vocab = len(constrained), logits.shape[1]
        bitmask = self._buffer(num_rows, (vocab + 31) // 32)
        # What llguidance.torch.fill_next_token_bitmask_par does, without importing that module (it sets up
        # torch.compile, which costs seconds and memory): the executor writes row j at data_ptr + j * row bytes.
        matchers = [(rows[i].matcher, j) for j, i in enumerate(constrained)]
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), bitmask.shape[1] * 4, num_rows)
        # Bit t of the little-endian bitmask is token t: unpacked, [num_rows, V] of 0 / 1.
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
        forbidden = torch.from_numpy(bits) == 0
        if num_rows == len(rows):
            logits.masked_fill_(forbidden, float("-inf"))
            return
        index = torch.tensor(constrained, dtype=torch.long)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(forbidden, float("-inf")))

    def _buffer(self, num_rows: int, num_words: int) -> torch.Tensor:
        if self._bitmask.shape[0] < num_rows or self._bitmask.shape[1] != num_words:
            self._bitmask = torch.empty(max(num_rows, 8), num_words, dtype=torch.int32)
        return self._bitmask[:num_rows]  # contiguous: leading rows of a contiguous tensor
