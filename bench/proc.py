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


def read_memory(pid: int, proc: Path = PROC) -> tuple[int, int]:
    """(VmRSS, VmHWM: the peak resident set) in bytes. Raises OSError once the process is gone."""
    fields = dict(line.split(":", 1) for line in (proc / str(pid) / "status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


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


def listening_inodes(port: int, proc: Path = PROC) -> set[str]:
    """Socket inodes listening on `port` (any address), from /proc/net/tcp and tcp6."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def listening_pid(port: int, proc: Path = PROC) -> int | None:
    """The process holding the socket that listens on `port` (readable processes only), or None."""
    wanted = {f"socket:[{inode}]" for inode in listening_inodes(port, proc)}
    if not wanted:
        return None
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in wanted for fd in (entry / "fd").iterdir()):
                return int(entry.name)
        except OSError:
            continue
    return None
