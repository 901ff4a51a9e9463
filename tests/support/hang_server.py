"""`python -m web.server`, except that a forward pass hangs for good once a request with temperature
HANG_TEMPERATURE is in it: the injected hang of the watchdog and shutdown tests. Run from the repository root as
`python -m tests.support.hang_server`."""

from __future__ import annotations

import sys
import threading

from engine.llm_engine import LLMEngine
from web.server import main

HANG_TEMPERATURE = 0.123
_real_execute = LLMEngine.execute


def execute(self: LLMEngine, plan):  # type: ignore[no-untyped-def]
    if any(c.sampling is not None and c.sampling.temperature == HANG_TEMPERATURE for c in plan.batch.chunks):
        threading.Event().wait()  # never returns
    return _real_execute(self, plan)


if __name__ == "__main__":
    LLMEngine.execute = execute  # type: ignore[method-assign]
    sys.exit(main())
