"""`python -m bench` end to end against a real Sluice server on the tiny local model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from bench.servers import REPO_ROOT, free_port

STARTUP_SECONDS = 180


@contextmanager
def running_sluice(model_dir: Path, log: Path, *extra_args: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """A Sluice server on a free loopback port (its URL and process), stopped with SIGTERM on exit."""
    port = free_port()
    command = [sys.executable, "-m", "web.server", "--model", str(model_dir), "--dtype", "float32",
               "--host", "127.0.0.1", "--port", str(port), *extra_args]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                   env=dict(os.environ, HF_HUB_OFFLINE="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            assert process.poll() is None, f"server exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"server not ready:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        yield url, process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def sluice_url(tiny_llama_dir: Path, tmp_path_factory):
    # A small admission queue, so that the burst below may see 429s (they must be counted, not lost).
    log = tmp_path_factory.mktemp("sluice") / "server.log"
    with running_sluice(tiny_llama_dir, log, "--max-pending", "4") as (url, _):
        yield url


def run_bench(args: list[str], out: Path) -> dict:
    command = [sys.executable, "-m", "bench", "--no-progress", "--json", str(out), *args]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TTFT ms" in done.stdout
    return json.loads(out.read_text())


def check_accounting(level: dict, sent: int, max_tokens: int) -> None:
    assert level["sent"] == sent
    assert level["completed"] + level["rejected_429"] + level["errors"] == sent
    assert level["errors"] == 0, level["error_samples"]
    assert level["usage_reported"]
    assert level["completion_tokens"] == max_tokens * level["completed"]  # ignore_eos: exactly max_tokens each
    ok = [r for r in level["requests"] if r["status"] == 200]
    assert len(ok) == level["completed"]
    assert level["prompt_tokens"] == sum(r["prompt_tokens"] for r in ok) > 0
    assert all(r["finish_reason"] == "length" and r["ttft"] is not None for r in ok)
    assert level["ttft_s"]["n"] == level["completed"]


def test_closed_loop_sweep_on_both_endpoints(sluice_url: str, tmp_path: Path) -> None:
    for endpoint in ("chat", "completions"):
        data = run_bench(["--url", sluice_url, "--endpoint", endpoint, "--sweep", "1,3", "--num-requests", "6",
                          "--prompt-tokens", "uniform:4:24", "--output-tokens", "8", "--warmup", "1"],
                         tmp_path / f"{endpoint}.json")
        assert [(lv["mode"], lv["level"]) for lv in data["levels"]] == [("closed", 1), ("closed", 3)]
        for level in data["levels"]:
            check_accounting(level, 6, 8)
            assert level["rejected_429"] == 0  # at most 3 in flight, 4 may wait
            assert level["itl_s"]["n"] > 0
        assert data["config"]["targets"][0]["model"]  # discovered from /v1/models


def test_burst_counts_every_request(sluice_url: str, tmp_path: Path) -> None:
    data = run_bench(["--url", sluice_url, "--burst", "24", "--output-tokens", "6", "--prompt-tokens", "16",
                      "--warmup", "0"], tmp_path / "burst.json")
    (level,) = data["levels"]
    check_accounting(level, 24, 6)
    assert level["admission_s"]["n"] == 24
    assert all(r["status"] in (200, 429) for r in level["requests"])
