"""transformers' lazy import table, kept on disk between starts.

Importing transformers reads every file of its ~450 model folders (110 MB of source) for its `__all__` to build the
table its lazy module resolves names from: 0.25 s of every start, and the same table every time for one installed
transformers. install() has that table kept under cache_root, keyed by the folder's path, its package's __init__.py
(written anew by each version) and the mtimes of its subfolders (a file added or removed is a new key); a
transformers outside site-packages (a source checkout, whose files change under one version) is never kept. It must
run before transformers' first import: later it does nothing. If transformers stops building its table this way,
nothing is kept and transformers builds it as ever.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
import xxhash

from engine.checkpoint.lru_folder import evict_least_recently_used

log = logging.getLogger(__name__)

FORMAT = "1"
TABLE_MODULE = "transformers.utils.import_utils"
DIR_NAME = "transformers-imports"
MAX_ENTRIES = 8
Table = dict[frozenset[str], dict[str, set[str]]]  # backends needed -> module -> names it exports


def install(cache_root: Path | None) -> None:
    """Keep the table under cache_root from transformers' first import on (None, or transformers already imported:
    nothing)."""
    if cache_root is None or TABLE_MODULE in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder(cache_root / DIR_NAME))


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when transformers' import_utils is found, its loader is given one step more."""

    def __init__(self, entries: Path) -> None:
        self.entries = entries

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name != TABLE_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            spec.loader.exec_module = partial(_exec_then_wrap, spec.loader.exec_module, self.entries)  # type: ignore[method-assign]
        return spec


def _exec_then_wrap(exec_module: Callable[[ModuleType], None], entries: Path, module: ModuleType) -> None:
    exec_module(module)
    build = getattr(module, "define_import_structure", None)
    if callable(build):
        module.define_import_structure = partial(_kept_table, build, entries)  # type: ignore[attr-defined]


def _kept_table(build: Callable[..., Table], entries: Path, module_path: Any, prefix: str | None = None) -> Table:
    """define_import_structure, read from its entry for transformers' models folder (its other callers, each
    model's own small folder, go straight through)."""
    models = Path(module_path)
    key = _entry_key(models) if prefix == "models" and models.name == "models" else None
    if key is None:
        return build(module_path, prefix)
    entry = entries / f"{key}.json"
    try:
        table = _decoded(orjson.loads(entry.read_bytes()))
        os.utime(entry)  # the most recently used entries are kept
        log.debug("transformers' import table read from %s", entry)
        return table
    except (OSError, ValueError, TypeError, AttributeError):
        pass  # none yet, or damaged: built and written again
    table = build(module_path, prefix)
    _write(entries, entry, _encoded(table))
    return table


def _entry_key(models: Path) -> str | None:
    """None for a transformers outside site-packages (a source checkout, whose files change under one version)."""
    if not {"site-packages", "dist-packages"} & set(models.parts):
        return None
    try:
        package = (models.parent / "__init__.py").stat()  # a new version writes it anew
        digest = xxhash.xxh64(f"{FORMAT}\0{models}\0{package.st_mtime_ns}\0{package.st_size}\0".encode())
        with os.scandir(models) as folders:
            for folder in sorted(folders, key=lambda entry: entry.name):
                digest.update(f"{folder.name}\0{folder.stat().st_mtime_ns}\0".encode())
    except OSError:
        return None
    return digest.hexdigest()


def _encoded(table: Table) -> bytes:
    return orjson.dumps([[sorted(backends), {m: sorted(names) for m, names in modules.items()}]
                         for backends, modules in table.items()])  # fmt: skip


def _decoded(rows: list[Any]) -> Table:
    table = {frozenset(backends): {m: set(names) for m, names in modules.items()} for backends, modules in rows}
    if not table.get(frozenset()):  # transformers adds its own top-level names to this row
        raise ValueError("not a table of transformers' models")
    return table


def _write(entries: Path, entry: Path, data: bytes) -> None:
    """Whole or not at all (a temporary file renamed into place); the MAX_ENTRIES most recently used entries are
    kept (one for each environment that shares the cache: a venv's transformers is a key of its own). An unwritable
    cache costs only the next start's 0.25 s."""
    try:
        entries.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=entries, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.replace(temporary, entry)
        finally:
            Path(temporary).unlink(missing_ok=True)  # still there only if the rename failed
        # a writer's temporary file is among the newest
        evict_least_recently_used(entries, MAX_ENTRIES, partial(Path.unlink, missing_ok=True))
    except OSError as error:
        log.debug("transformers' import table not kept: %s", error)
