"""A process's resident memory, open file descriptors and threads, read from /proc (Linux only)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcessSample:
    at: float  # time.monotonic() when read
    rss_bytes: int
    num_fds: int
    num_threads: int


def parse_status(text: str) -> tuple[int, int]:
    """(VmRSS in bytes, Threads) from the text of /proc/PID/status."""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        rss_kib = int(fields["VmRSS"].split()[0])  # "  123456 kB"
        threads = int(fields["Threads"])
    except (KeyError, ValueError, IndexError):
        raise ValueError("no VmRSS/Threads in the status text (a zombie, or not Linux)") from None
    return rss_kib * 1024, threads


def count_fds(pid: int, proc: Path = PROC) -> int:
    return len(os.listdir(proc / str(pid) / "fd"))


def read_process(pid: int, proc: Path = PROC) -> ProcessSample:
    """Raises OSError (FileNotFoundError once the process is gone, PermissionError for another user's)."""
    rss, threads = parse_status((proc / str(pid) / "status").read_text())
    return ProcessSample(time.monotonic(), rss, count_fds(pid, proc), threads)


def is_alive(pid: int, proc: Path = PROC) -> bool:
    try:
        read_process(pid, proc)
    except (OSError, ValueError):
        return False
    return True
