"""A `sluice serve --replicas 2` process on a random model, in a session of its own, for the replica tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.server_harness import REPO, free_port, health, wait_until

MODEL = "tiny"
START_TIMEOUT = 600.0  # Ray's start and two model loads on a busy 2-core machine


class ClusterServer:
    def __init__(self, model_dir: Path, log_path: Path, *extra_args: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = ["--model", str(model_dir), "--dtype", "float32", "--quantize", "none", "--block-size", "4",
                "--num-kv-blocks", "256", "--max-num-seqs", "16", "--max-num-batched-tokens", "256",
                "--num-threads", "1", "--served-model-name", MODEL, "--port", str(self.port),
                "--max-pending", "8", "--drain-timeout", "60", "--replicas", "2", *extra_args]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_DISABLE_USAGE_STATS": "1"}
        self.log = open(log_path, "wb")
        # A session of its own: teardown can end the front and the Ray processes it started, by group id.
        self.process = subprocess.Popen([sys.executable, "-m", "web.server", *args], cwd=REPO, env=env,
                                        stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def wait_ready(self) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited {self.process.returncode}:\n{self.log_text()[-3000:]}")
            status, body = health(self.base_url)
            return status == 200 and body["replicas"]["ready"] == 2

        wait_until(ready, timeout=START_TIMEOUT, interval=1.0)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def replicas(self) -> list[dict[str, Any]]:
        return health(self.base_url)[1]["replicas"]["replicas"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # whatever of Ray is left in the server's own session
        except ProcessLookupError:
            pass
        self.log.close()
