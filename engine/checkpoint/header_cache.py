"""What transformers builds from a GGUF's header, its config and its tokenizer, kept on disk between starts.

Building them is most of a start that is not importing torch: the config's class pulls in torch.distributed and
sympy through transformers' imports (~1.2 s), and converting a vocabulary takes 0.2 s for 49k tokens and 3 s for
Gemma 3's 262k (BPE merges rebuilt in Python). Both depend on the header alone (metadata and tensor table), so an
entry is keyed by the header's bytes, the versions of transformers and tokenizers, and the source of Sluice's own
conversion: a changed file, library or rule is a new entry, never a stale one. A cached config comes back as
transformers' PreTrainedConfig carrying every value the model's own class set (its to_dict()).

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
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

log = logging.getLogger(__name__)

FORMAT = "1"  # of an entry's files
MAX_ENTRIES = 16
_SOURCES = ("gguf_config.py", "gguf_file.py", "header_cache.py")  # the conversion's rules
CONFIG_FILE = "config.json"
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

    def config(self, build: Callable[[], Any]) -> Any:
        """transformers' config of the model, from build() (the model's own config class) or from the entry."""

        def load(folder: Path) -> Any:
            from transformers.configuration_utils import PreTrainedConfig

            values = json.loads((folder / CONFIG_FILE).read_text())
            config = PreTrainedConfig(**values)
            for key, value in values.items():  # the few the base class keeps elsewhere (e.g. use_cache)
                if not hasattr(config, key):
                    setattr(config, key, value)
            return config

        cached = self._read("config", CONFIG_FILE, load)
        if cached is not None:
            return cached
        config = build()
        self._write("config", lambda folder: (folder / CONFIG_FILE).write_text(config.to_json_string(use_diff=False)))
        return config

    def tokenizer(self, build: Callable[[], tuple[Any, dict[str, Any]]]) -> Any:
        """transformers' fast tokenizer of a converted vocabulary: build() gives the vocabulary (a
        tokenizers.Tokenizer) and the keyword arguments it is wrapped with (plain JSON values). From the entry the
        wrapper reads the vocabulary's file itself (given a Tokenizer object it deep-copies it: 1.1 s for Gemma
        3's)."""
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
        return PreTrainedTokenizerFast(tokenizer_object=vocabulary, **kwargs)

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
        """All but the MAX_ENTRIES most recently used entries (another process may be evicting too)."""
        assert self.entries is not None

        def last_used(entry: Path) -> float:
            try:
                return entry.stat().st_mtime
            except OSError:
                return 0.0

        entries = sorted(self.entries.iterdir(), key=last_used, reverse=True)
        for stale in entries[MAX_ENTRIES:]:
            shutil.rmtree(stale, ignore_errors=True)
