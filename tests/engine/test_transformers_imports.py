"""transformers' lazy import table kept between starts: the table kept is transformers' own, a later start reads it,
and a damaged or unwritable cache costs nothing but the walk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import transformers
from transformers.utils import import_utils

from engine.checkpoint import transformers_imports
from engine.checkpoint.transformers_imports import DIR_NAME, MAX_ENTRIES

MODELS = Path(transformers.__file__).parent / "models"
# A start's own steps: the finder goes in as a checkpoint is opened, then transformers is imported and used.
START = (
    "import logging, sys; from pathlib import Path\n"
    "logging.basicConfig(level=logging.DEBUG, format='%(name)s: %(message)s')\n"
    "from engine.checkpoint.source import open_checkpoint\n"
    "assert 'transformers' not in sys.modules\n"
    "checkpoint = open_checkpoint('', Path(sys.argv[1]))\n"
    "from transformers import AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config\n"
    "from transformers.models.gemma3 import Gemma3TextConfig\n"
    "assert checkpoint.tokenizer().encode('héllo 世界 🙂')\n"
    "print('names', LlamaConfig.model_type, Qwen3Config.model_type, Gemma3TextConfig.model_type)\n"
)


def _start(cache_root: Path) -> str:
    done = subprocess.run([sys.executable, "-c", START, str(cache_root)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "names llama qwen3 gemma3_text" in done.stdout
    return done.stderr


def _entries(cache_root: Path) -> list[Path]:
    return sorted((cache_root / DIR_NAME).glob("*.json"))


def test_the_table_kept_is_transformers_own_and_a_later_start_reads_it(tmp_path: Path) -> None:
    first = _start(tmp_path)
    assert "import table read from" not in first
    [entry] = _entries(tmp_path)
    kept = transformers_imports._decoded(orjson.loads(entry.read_bytes()))
    assert kept == import_utils.define_import_structure.__wrapped__(MODELS, prefix="models")  # built afresh here
    assert f"import table read from {entry}" in _start(tmp_path)
    assert _entries(tmp_path) == [entry]


def test_a_damaged_entry_is_built_again_and_an_unwritable_cache_costs_nothing(tmp_path: Path) -> None:
    _start(tmp_path)
    [entry] = _entries(tmp_path)
    whole = entry.read_bytes()
    entry.write_bytes(whole[: len(whole) // 2])
    assert "import table read from" not in _start(tmp_path)
    assert entry.read_bytes() == whole
    for not_a_table in (b'[["torch"], {"models.llama": 3}]', b"[]"):  # JSON, but not transformers' table
        entry.write_bytes(not_a_table)
        _start(tmp_path)
        assert entry.read_bytes() == whole
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache's folder would be")
    assert "import table not kept" in _start(blocked)


def test_nothing_is_kept_for_a_source_checkout_nor_once_transformers_is_imported(tmp_path: Path) -> None:
    assert transformers_imports._entry_key(Path("/src/transformers/src/transformers/models")) is None
    assert transformers_imports._entry_key(MODELS) is not None  # the installed one
    finders = list(sys.meta_path)
    transformers_imports.install(tmp_path)  # transformers is imported in this process
    assert sys.meta_path == finders


def test_each_environment_keeps_its_entry_and_the_least_recently_used_go(tmp_path: Path) -> None:
    """Two venvs sharing a cache (their transformers are keys of their own) must not evict each other's entry at
    every start; past MAX_ENTRIES the least recently used goes."""
    entries = tmp_path / DIR_NAME
    build = import_utils.define_import_structure.__wrapped__
    data = transformers_imports._encoded(build(MODELS, prefix="models"))
    for i in range(MAX_ENTRIES):
        transformers_imports._write(entries, entries / f"venv{i}.json", data)
        os.utime(entries / f"venv{i}.json", (1e9 + i, 1e9 + i))  # venv0 the least recently used
    table = transformers_imports._kept_table(build, entries, MODELS, "models")  # this venv's: built and kept
    assert len(_entries(tmp_path)) == MAX_ENTRIES and not (entries / "venv0.json").exists()
    assert (entries / "venv1.json").exists()

    def walk(*_: object) -> dict:
        raise AssertionError("the kept table was not read")

    assert transformers_imports._kept_table(walk, entries, MODELS, "models") == table
