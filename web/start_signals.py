"""Signals before the server takes them over, and after it has let them go.

The start (imports, the config, building the host, the event loop and Hypercorn's bind: ~2 s) has no drain to run:
SIGTERM, SIGINT and SIGHUP end it at once with one line and exit 0. Without this, SIGTERM and SIGHUP killed the
process by the signal and SIGINT printed a KeyboardInterrupt traceback (or, raised inside torch's C++ start-up,
aborted it). These handlers stay until the server's own replace them (asyncio's, in the lifespan, before the model
starts loading), so no moment of the start is left to the defaults; nothing is open yet that needs closing, and the
header cache writes each entry whole (a temporary folder renamed into place).

The end (after the event loop has closed and removed the server's handlers: the interpreter's own teardown, ~0.5 s
with torch loaded, during which Python resets its handlers to the defaults) has nothing left to do either, and its
exit code is decided: the signals are ignored from then on (a second Ctrl-C after a quick drain killed the process by
the signal, once with a traceback). A teardown held by a forward pass still running is ended by web/asgi.py's timer.
"""

from __future__ import annotations

import os
import signal
import sys

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _stop_the_start(signum: int, _frame: object) -> None:
    sys.stderr.write(f"{signal.Signals(signum).name}: stopped before the server started\n")
    sys.stderr.flush()
    os._exit(0)  # not an exception: one raised inside a C++ extension's start-up aborts the process


def signals_stop_the_start() -> None:
    """From here until the server installs its own handlers, a signal ends the process (the main thread only)."""
    for signum in SIGNALS:
        signal.signal(signum, _stop_the_start)


def signals_stop_the_start_of_a_server_process() -> None:
    """signals_stop_the_start() where this process was started as the server: `python -m web.server` or the
    hypercorn command, whose first import of Sluice (this package) comes before torch's (~1.5 s, in which a Ctrl-C
    printed a KeyboardInterrupt traceback of 40-80 lines and SIGTERM killed the process by the signal). Elsewhere
    (tests, a program that imports web) the process's handlers stay its own; `sluice serve` installs them itself."""
    argv = getattr(sys, "orig_argv", [])
    run_module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else None  # `python -m` imports this package first
    if run_module in ("web.server", "hypercorn") or "hypercorn.__main__" in sys.modules:  # or the hypercorn script
        signals_stop_the_start()


def signals_ignored_while_exiting() -> None:
    """From here on (the server has stopped and decided its exit code), signals are ignored (SIG_IGN, which
    Python's teardown leaves in place)."""
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
