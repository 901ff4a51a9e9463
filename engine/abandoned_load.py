"""A model load in a worker thread that a stop may abandon (a load cannot be interrupted: the thread runs on until
the process exits). Once it is abandoned, what that thread still logs is dropped: the server has said "stopped",
and a load's lines after that read as if the server had started after all."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class AbandonableLoad(logging.Filter, Generic[T]):
    def __init__(self, load: Callable[[], T]) -> None:
        super().__init__()
        self._load = load
        self._lock = threading.Lock()
        self._thread_id: int | None = None
        self._is_done = False
        self._muted: list[logging.Handler] = []

    def __call__(self) -> T:
        """Runs the load (in the worker thread)."""
        self._thread_id = threading.get_ident()
        try:
            return self._load()
        finally:
            with self._lock:
                self._is_done = True
                for handler in self._muted:
                    handler.removeFilter(self)  # the thread goes back to the pool: its later work is heard again

    def start_thread(self) -> Future[T]:
        """Runs the load now, in a daemon thread of its own; the future gives its result (or its exception)."""
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(self())
            except BaseException as error:  # noqa: BLE001 -- handed to whoever waits on the future
                future.set_exception(error)

        threading.Thread(target=run, name="sluice-start", daemon=True).start()
        return future

    def abandon(self) -> None:
        """Called where the stop is (the event loop): the root handlers drop this load's records from now on."""
        with self._lock:
            if self._is_done:
                return
            self._muted = list(logging.getLogger().handlers)
            for handler in self._muted:
                handler.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self._thread_id
