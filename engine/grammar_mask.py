"""The grammar's share of sampling: tokens a row's matcher does not allow get -inf, for the whole batch at once.

Runs in the worker thread, after the forward pass, reading the matchers (the event-loop thread advances them
only after the step; a verification row's drafts are consumed and rolled back here, so each matcher is as it
was when the step ends). Each constrained row's bitmask is written by llguidance straight into one [R, V/32]
buffer (the call drops the GIL), then one table lookup turns the bitmask bytes into a 0 / -inf bias that is
added to those rows' logits.

Measured on this 2-core CPU (SmolLM2, 49152 tokens, 32 rows, a JSON schema; a shared machine, so ratios only):
- llguidance's LLExecutor fills the rows in parallel in its own thread pool, but its threads compete with
  torch's for the two cores: a 32-stream offline run went from ~430-530 tok/s (rows filled one after the
  other in this thread, ~1 ms for 32) to ~35-110. So the rows are filled here, in one short loop.
- Applying the mask: np.unpackbits + masked_fill_ took 6-8 ms (masked_fill_ with a bool mask is slow on CPU);
  the byte-table bias (index_select + add_) 0.3-0.6 ms.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from engine.batch import SamplingRow


def _byte_bias() -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where its bit is set (the token is allowed), -inf where not. Bits are
    little-endian: bit t of the bitmask is token t."""
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
    return torch.from_numpy(np.where(bits == 1, 0.0, -np.inf).astype(np.float32))


class GrammarMasker:
    def __init__(self) -> None:
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)
        self._byte_bias = _byte_bias()

    def apply_(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        """In place on [N, V] float32 logits: every row with a matcher keeps only the tokens its grammar allows
        next (the others become -inf, and so does a NaN among the allowed)."""
        constrained = [i for i, row in enumerate(rows) if row.matcher is not None]
        if not constrained:
            return
        num_rows, vocab = len(constrained), logits.shape[1]
        bitmask = self._buffer(num_rows, (vocab + 31) // 32)
        row_bytes = bitmask.shape[1] * 4
        address = bitmask.data_ptr()
        for j, i in enumerate(constrained):
            matcher, lookahead, clock = rows[i].matcher, rows[i].matcher_lookahead, rows[i].grammar_clock
            start = time.thread_time()
            if lookahead and not matcher.consume_tokens(list(lookahead)):
                raise RuntimeError(f"the grammar refused drafts it had validated: {matcher.get_error()}")
            matcher.unsafe_compute_mask_ptr(address + j * row_bytes, row_bytes)
            if lookahead:
                matcher.rollback(len(lookahead))
            if clock is not None:
                clock.add_mask(time.thread_time() - start)
        bias = self._byte_bias.index_select(0, bitmask.view(torch.uint8).flatten().long()).view(num_rows, -1)
        bias = bias[:, :vocab]
        if num_rows == len(rows):
            _add_bias_(logits, bias)
            return
        index = torch.tensor(constrained, dtype=torch.long)
        logits.index_copy_(0, index, _add_bias_(logits.index_select(0, index), bias))

    def _buffer(self, num_rows: int, num_words: int) -> torch.Tensor:
        if self._bitmask.shape[0] < num_rows or self._bitmask.shape[1] != num_words:
            self._bitmask = torch.empty(max(num_rows, 8), num_words, dtype=torch.int32)
        return self._bitmask[:num_rows]  # contiguous: leading rows of a contiguous tensor


def _add_bias_(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    # +inf plus -inf is NaN: a forbidden token must never win, so NaN becomes -inf (+inf the largest float).
    return logits.add_(bias).nan_to_num_(nan=float("-inf"), neginf=float("-inf"))
