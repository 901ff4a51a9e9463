"""Measurements apart from the load generator, each a mode of `python -m bench` (bench/modes.py)."""
