"""The native step: a C++ extension built by `make install` (see build.py), loaded here if it is there.

`native_ops()` is the compiled module, or None: not built, built for another torch, or turned off with
SLUICE_NATIVE=0. Either way the engine keeps working on its eager PyTorch path, and says why once in the log.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from functools import lru_cache
from types import ModuleType

from pathlib import Path

log = logging.getLogger(__name__)

ENV_SWITCH = "SLUICE_NATIVE"
BUILD_DIR = Path(__file__).resolve().parent / "_build"  # gitignored; `make install` fills it
MODULE_NAME = "sluice_native"


@lru_cache(maxsize=1)
def native_ops() -> ModuleType | None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        log.warning("%s=0: the native step is off; using the eager PyTorch path", ENV_SWITCH)
        return None
    path = BUILD_DIR / f"{MODULE_NAME}.so"
    if not path.is_file():
        log.warning("the native step is not built (%s missing: run `make install`); using the eager PyTorch path", path)
        return None
    try:
        import torch  # noqa: F401 - the extension links against torch's libraries

        spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - e.g. built against another torch: rebuild with `make install`
        log.warning("the native step failed to load (%s); using the eager PyTorch path", exc)
        return None
    log.info("native step loaded (%s kernels)", module.isa())
    return module
