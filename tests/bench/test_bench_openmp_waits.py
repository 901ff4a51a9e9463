"""Every bench mode measures with the OpenMP waits the server runs with: GOMP_SPINCOUNT is set (by the engine
package) before a mode's first import loads torch, which reads it once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HOOK = """
import importlib.abc, os, sys
class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" and "torch" not in sys.modules:
            print("at torch:", os.environ.get("GOMP_SPINCOUNT"))
        return None
sys.meta_path.insert(0, Hook())
import {module}
import torch  # where the mode loads it in its main()
"""


@pytest.mark.parametrize("module", ["bench.kernels", "bench.experiments.variants", "bench.experiments.step",
                                    "bench.perplexity", "bench.experiments.offline"])  # fmt: skip
def test_torch_loads_after_the_engine_sets_the_openmp_waits(module: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", HOOK.format(module=module)], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout  # fmt: skip
    assert out.splitlines()[0] == "at torch: 1000", out
