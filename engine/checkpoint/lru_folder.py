"""A cache folder's entries kept by last use: an entry's mtime is its last use (its reader touches it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def evict_least_recently_used(folder: Path, num_kept: int, remove: Callable[[Path], None]) -> None:
    """All but the num_kept most recently used entries of folder go (another process may be evicting too: an entry
    gone meanwhile counts as the oldest)."""

    def last_used(entry: Path) -> float:
        try:
            return entry.stat().st_mtime
        except OSError:
            return 0.0

    for stale in sorted(folder.iterdir(), key=last_used, reverse=True)[num_kept:]:
        remove(stale)
