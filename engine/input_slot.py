"""Where a request is templated and tokenized: on the event loop when it is small, in a worker thread when not.

Templates (jinja) and the tokenizer's Python side hold the GIL nearly throughout, so a worker thread buys a small
input no parallelism, only latency: each await on the way costs a lap of an event loop that, with 64 streams
decoding, spends ~20 ms after every step sending their events (measured: the preparation of a 64-token chat took
13-34 ms p50 through the thread, of which 0.4-0.7 ms was the work itself). A large input (a long document, a long
conversation, many tools) still goes to the thread, so that the streams keep flowing while it is prepared. One job
at a time either way: the tokenizer is never used from two threads at once.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

T = TypeVar("T")

# Characters (or token ids) prepared on the event loop: ~400 tokens. A chat of 2,000 characters took 1.9 ms p50
# (300 characters: 0.6 ms; 8,192: 6 ms) on a 2-core Xeon guest (bench/RESULTS.md, 2026-11-27, sixteenth session).
MAX_INLINE_SIZE = 2048
# An inline job that took longer than this lets the loop run its other tasks before its caller goes on, so that
# the prompts of one request (a completion may carry many) are not prepared back to back without a pause.
YIELD_AFTER_SECONDS = 0.001


class InputSlot:
    def __init__(self, max_inline_size: int = MAX_INLINE_SIZE) -> None:
        self.max_inline_size = max_inline_size
        self._limiter = anyio.CapacityLimiter(1)

    async def run(self, work: Callable[[], T], size: int) -> T:
        """work() on the loop if size is small and no large job holds the slot, else in the worker thread."""
        if size <= self.max_inline_size:
            try:
                self._limiter.acquire_nowait()
            except anyio.WouldBlock:
                pass  # a large job is being prepared: wait in line behind it
            else:
                start = time.perf_counter()
                try:
                    result = work()
                finally:
                    self._limiter.release()
                if time.perf_counter() - start > YIELD_AFTER_SECONDS:
                    await anyio.lowlevel.checkpoint()
                return result
        return await anyio.to_thread.run_sync(work, limiter=self._limiter)


def prompt_size(prompt: Any) -> int:
    """A text's characters or a list's token ids (anything else is refused by the processor, cheaply)."""
    return len(prompt) if isinstance(prompt, (str, list)) else 0


def chat_size(messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any]) -> int:
    """Roughly the characters the template renders: the messages and the tools or documents beside them."""
    if not isinstance(messages, (list, tuple)):
        return 0
    return sum(len(str(m)) for m in messages) + (len(str(template_kwargs)) if template_kwargs else 0)


def with_grammar(size: int, compiler: Any, params: Any) -> int:
    """A request's size with its grammar's (compiler: its GrammarCompiler; params: SamplingParams). The first
    grammar also builds llguidance's view of the vocabulary (0.3 s for 49k tokens, ~2.5 s for Gemma 3's 262k): that
    request goes to the thread, so that the loop runs wherever the build lets go of the GIL (its Rust part does not:
    the streams pause for that part once)."""
    structured = getattr(params, "structured_outputs", None)
    if structured is None:
        return size
    return size + len(repr(structured)) if compiler.has_tokenizer else sys.maxsize
