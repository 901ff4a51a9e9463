"""What transformers builds from a GGUF's header, its tokenizer, kept on disk between starts.

Converting a vocabulary takes ~0.45 s for 49k tokens and 3 s for Gemma 3's 262k (BPE merges rebuilt in Python). It
depends on the header alone (metadata and tensor table), so an entry is keyed by the header's bytes, the versions
of transformers and tokenizers, and the source of Sluice's own conversion: a changed file, library or rule is a
new entry, never a stale one. (The config is not kept: gguf_config builds it in milliseconds.)

An entry is written whole into a temporary folder and renamed into place; an unreadable one is rebuilt. The
MAX_ENTRIES most recently used entries are kept (an entry is tens of MB at most: Gemma 3's vocabulary is 32 MB).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from engine.checkpoint.lru_folder import evict_least_recently_used

log = logging.getLogger(__name__)

FORMAT = "2"  # of an entry's files
MAX_ENTRIES = 16
_SOURCES = ("gguf_file.py", "gguf_tokenizer.py", "header_cache.py")  # the conversion's rules
TOKENIZER_FILE = "tokenizer.json"  # written last: an entry with it is whole
TOKENIZER_KWARGS = "kwargs.json"


def entry_key(header: np.ndarray) -> str:
    from importlib.metadata import version

    digest = xxhash.xxh64()
    for part in (FORMAT, version("transformers"), version("tokenizers")):
        digest.update(part.encode() + b"\0")
    here = Path(__file__).parent
    for name in _SOURCES:
        digest.update((here / name).read_bytes())
    digest.update(memoryview(header))
    return digest.hexdigest()


class HeaderCache:
    """One GGUF header's entry under root (no root: nothing is kept)."""

    def __init__(self, root: Path | None, header: np.ndarray) -> None:
        self.entries = root / "gguf-header" if root is not None else None
        self.dir = self.entries / entry_key(header) if self.entries is not None else None

    def tokenizer(self, build: Callable[[], tuple[Any, dict[str, Any]]]) -> Any:
        """transformers' fast tokenizer of a converted vocabulary: build() gives the vocabulary (a
        tokenizers.Tokenizer) and the keyword arguments it is wrapped with (plain JSON values). From the entry the
        wrapper reads the vocabulary's file itself; a vocabulary just built it takes as transformers' own tokenizer
        classes do (set before __init__), where given it as `tokenizer_object` it would deep-copy it (1.2 s of
        Gemma 3's 262k vocabulary, 0.1 s of a 49k one): nothing else holds it once it is saved."""
        from transformers import PreTrainedTokenizerFast

        def load(folder: Path) -> Any:
            kwargs = json.loads((folder / TOKENIZER_KWARGS).read_text())
            return PreTrainedTokenizerFast(tokenizer_file=str(folder / TOKENIZER_FILE), **kwargs)

        def save(folder: Path) -> None:
            (folder / TOKENIZER_KWARGS).write_text(json.dumps(kwargs))
            vocabulary.save(str(folder / TOKENIZER_FILE))

        cached = self._read("tokenizer", TOKENIZER_FILE, load)
        if cached is not None:
            return cached
        vocabulary, kwargs = build()
        self._write("tokenizer", save)
        wrapper = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
        wrapper._tokenizer = vocabulary
        wrapper.__init__(**kwargs)
        return wrapper

    def _read(self, what: str, marker: str, load: Callable[[Path], Any]) -> Any | None:
        """The entry's `what`, or None when there is none or it is unreadable (then rebuilt by the caller)."""
        if self.dir is None or not (self.dir / what / marker).is_file():
            return None
        try:
            value = load(self.dir / what)
        except Exception as exc:  # noqa: BLE001 - a damaged or foreign entry
            log.warning("cached %s in %s unreadable (%s): building it again", what, self.dir, exc)
            return None
        with contextlib.suppress(OSError):
            os.utime(self.dir)  # used: evicted last
        log.info("%s of this GGUF header read from %s", what, self.dir)
        return value

    def _write(self, what: str, save: Callable[[Path], None]) -> None:
        if self.dir is None:
            return
        final = self.dir / what
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{what}-", dir=self.dir))
            try:
                save(staging)
                shutil.rmtree(final, ignore_errors=True)
                os.replace(staging, final)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        except Exception as exc:  # noqa: BLE001 - e.g. a read-only or full disk: the next start builds it again
            log.info("cannot cache the %s under %s: %s", what, self.dir, exc)
            return
        self._evict()

    def _evict(self) -> None:
        assert self.entries is not None
        evict_least_recently_used(self.entries, MAX_ENTRIES, partial(shutil.rmtree, ignore_errors=True))
