"""A Sluice server in its own process (`python -m web.server`) for the bench integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

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
