"""Requests and probes shared by the server lifecycle tests: a long and a short greedy completion on the tiny
model, a Prometheus metric's value, and whether the engine is idle with every KV block free."""

from __future__ import annotations

import re

import httpx

from tests.support.server_harness import health


MODEL = "tiny"
LONG = {"model": MODEL, "prompt": "Hello world", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
SHORT = {"model": MODEL, "prompt": "Hello world", "max_tokens": 3, "temperature": 0, "ignore_eos": True}


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def engine_idle(base_url: str) -> bool:
    status, state = health(base_url)
    return (
        status == 200
        and state["running"] == state["waiting"] == state["pending"] == 0
        and state["free_kv_blocks"] == state["total_kv_blocks"]
    )
