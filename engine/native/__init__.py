"""The native step: a C++ extension built by `make install` (see build.py), loaded here if it is there.

`native_ops()` is the compiled module, or None: not built, built for another torch, or turned off with
SLUICE_NATIVE=0. Either way the engine keeps working on its eager PyTorch path, and says why once in the log.

The kernels come in four variants (avx512, avxvnni: AVX2 with AVX-VNNI, avx2, baseline), the best the CPU has
chosen at run time; SLUICE_ISA=avx512|avxvnni|avx2|baseline forces one (to measure or test a variant on a bigger
CPU), and is refused with a RuntimeError when the CPU lacks it.
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
SWITCH_ON, SWITCH_OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")  # as config.toml's booleans
ENV_ISA = "SLUICE_ISA"
ISA_VARIANTS = ("avx512", "avxvnni", "avx2", "baseline")  # the extension's: isa_avx512 ... isa_base
BUILD_DIR = Path(__file__).resolve().parent / "_build"  # gitignored; `make install` fills it
MODULE_NAME = "sluice_native"


@lru_cache(maxsize=1)
def native_ops() -> ModuleType | None:
    switch = os.environ.get(ENV_SWITCH, "1").strip().lower()
    if switch not in SWITCH_ON + SWITCH_OFF:  # a value read as "on" unnoticed would leave the step on
        raise ValueError(f"{ENV_SWITCH}={switch!r}: 0, false, no or off turns the native step off; 1, true, yes or on")
    if switch in SWITCH_OFF:
        log.warning("%s=%s: the native step is off; using the eager PyTorch path", ENV_SWITCH, switch)
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
    forced = os.environ.get(ENV_ISA)
    if forced:
        use_isa(module, forced)
    log.info("native step loaded (%s kernels)", module.isa())
    return module


def available_isas(module: ModuleType) -> list[str]:
    """The kernel variants this CPU can run, best first."""
    found = [name for name in ISA_VARIANTS if _try_isa(module, name)]
    module.set_isa("best")
    return found


def use_isa(module: ModuleType, name: str) -> None:
    """Run the kernels of variant `name` (one of ISA_VARIANTS, or "best") from now on. ValueError (a setting
    refused: a start says it in one line) for a name that is none, or a variant this CPU cannot run."""
    if name != "best" and name not in ISA_VARIANTS:
        raise ValueError(f"{ENV_ISA}={name!r}: the kernel variants are {', '.join(ISA_VARIANTS)}")
    if not _try_isa(module, name):
        raise ValueError(
            f"{ENV_ISA}={name}: this CPU cannot run the {name} kernels (it can run: {', '.join(available_isas(module))})"
        )


def _try_isa(module: ModuleType, name: str) -> bool:
    try:
        module.set_isa("base" if name == "baseline" else name)
    except RuntimeError:
        return False
    return True
