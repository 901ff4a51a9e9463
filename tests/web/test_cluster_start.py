"""A replicas front told to stop while Ray Serve starts: after its own module's cluster has gone (a Ray of its own)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.support.cluster_server import START_TIMEOUT, ClusterServer
from tests.support.server_harness import wait_until

pytest.importorskip("ray", reason="the cluster extra (pip install -e '.[cluster]') is not installed")


def test_a_sigterm_while_serve_starts_drains_and_exits_0(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """ray.init installs a native SIGTERM handler (a stack dump, then abort: exit 134) that the front takes back
    as soon as Ray is up, not once Serve and the replicas have started (seconds later)."""
    server = ClusterServer(tiny_llama_dir, tmp_path / "server.log")
    try:
        wait_until(lambda: "Ray is up" in server.log_text() or server.process.poll() is not None,
                   timeout=START_TIMEOUT, interval=0.05)  # fmt: skip
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(120) == 0, server.log_text()[-3000:]
        assert "SIGTERM received at time" not in server.log_text()
    finally:
        server.close()
