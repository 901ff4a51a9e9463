"""Sluice's measurements (python -m bench). Importing the engine package first sets the OpenMP waits the server
runs with (GOMP_SPINCOUNT, engine/__init__.py) before any mode loads torch: a mode measured without them measures
a configuration the server never runs (on a busy machine, one-row steps 100x slower)."""

import engine  # noqa: F401
