"""The native step's OpenMP threads spin briefly at barriers unless the user chose otherwise (engine/__init__.py):
set before torch loads libgomp, which reads it once."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.server_harness import REPO

SHOW = "import engine, torch, os; print(os.environ.get('GOMP_SPINCOUNT'))"


def spin_count_seen(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", SHOW], cwd=REPO, env={**clean, **env}, capture_output=True, text=True,
                          check=True)  # fmt: skip
    return done.stdout.strip()


def test_brief_spins_unless_the_user_set_a_wait_policy() -> None:
    assert spin_count_seen() == "1000"
    assert spin_count_seen(GOMP_SPINCOUNT="5") == "5"
    assert spin_count_seen(OMP_WAIT_POLICY="active") == "None"
