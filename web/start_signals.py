"""A signal during the start: before the server takes the signals over (its imports, the config, building the host:
~1.7 s), SIGTERM, SIGINT and SIGHUP end the process at once with one line and exit 0, as a drain of nothing would.
Without this, SIGTERM and SIGHUP killed the process by the signal and SIGINT printed a KeyboardInterrupt traceback
(or, raised inside torch's C++ start-up, aborted it). Nothing is open yet that needs closing: the model loads
later, and the header cache writes each entry whole (a temporary folder renamed into place)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _stop(signum: int, _frame: object) -> None:
    sys.stderr.write(f"{signal.Signals(signum).name}: stopped before the server started\n")
    sys.stderr.flush()
    os._exit(0)  # not an exception: one raised inside a C++ extension's start-up aborts the process


@contextmanager
def signals_stop_the_start() -> Iterator[None]:
    """Inside, one of SIGNALS ends the process; the handlers from before are back on the way out, before the
    server installs its own (which must not fall back to these)."""
    previous = {signum: signal.signal(signum, _stop) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
