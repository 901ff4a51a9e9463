"""How the server process ends, as a supervisor sees it: a stalled step (the watchdog), SIGTERM with a stuck
forward pass, and SIGTERM to the process group of the README's hypercorn command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from tests.support.hang_server import HANG_TEMPERATURE
from tests.support.lifecycle import LONG, MODEL, SHORT
from tests.support.server_harness import REPO, free_port, health, parse_sse, wait_until


TINY_ARGS = ["--dtype", "float32", "--served-model-name", MODEL, "--num-kv-blocks", "256", "--max-num-seqs", "8",
             "--max-num-batched-tokens", "256", "--num-threads", "1"]  # fmt: skip
HANG = {**SHORT, "temperature": HANG_TEMPERATURE, "max_tokens": 5}


def start_hang_server(model_dir: Path, port: int, **env: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "tests.support.hang_server", "--model", str(model_dir), "--port", str(port),
               *TINY_ARGS]
    return subprocess.Popen(command, cwd=REPO, env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)  # fmt: skip


def read_stream(base_url: str, body: dict[str, Any], answered: threading.Event | None = None) -> list[Any]:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            if answered is not None:
                answered.set()
            return parse_sse(response.iter_lines())[0]


def wait_ready(process: subprocess.Popen, base_url: str) -> None:
    wait_until(lambda: health(base_url)[0] == 200 or process.poll() is not None, timeout=120)
    assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


def test_a_stalled_step_reports_stalled_ends_streams_and_exits_non_zero(tiny_llama_dir) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    process = start_hang_server(tiny_llama_dir, port, SLUICE_STEP_TIMEOUT="1")
    try:
        wait_ready(process, base_url)
        with ThreadPoolExecutor(2) as pool:
            hung = pool.submit(read_stream, base_url, HANG)
            wait_until(lambda: health(base_url)[1].get("state") == "stalled", timeout=10)
            assert health(base_url)[0] == 503
            events = hung.result(timeout=10)
        assert events[-1] == "[DONE]" and "stalled" in events[-2]["error"]["message"]
        started = time.monotonic()
        assert process.wait(timeout=15) == 1  # a supervisor restarts it
        assert time.monotonic() - started < 15
    finally:
        stop(process)


def test_sigterm_ends_the_process_in_bounded_time_even_with_a_stuck_forward_pass(tiny_llama_dir) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    process = start_hang_server(tiny_llama_dir, port, SLUICE_DRAIN_TIMEOUT="1")  # step_timeout stays 120 s
    try:
        wait_ready(process, base_url)
        with ThreadPoolExecutor(1) as pool:
            hung = pool.submit(read_stream, base_url, HANG)
            wait_until(lambda: health(base_url)[1].get("running") == 1, timeout=10)
            time.sleep(0.2)
            sent = time.monotonic()
            process.send_signal(signal.SIGTERM)
            events = hung.result(timeout=15)
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort"
        assert process.wait(timeout=15) != 0  # a forward pass had to be abandoned
        # drain_timeout (1 s) + the stop margin (2 s) + the hard-exit delay (5 s) + start-up slack
        assert time.monotonic() - sent < 12
    finally:
        stop(process)


def test_the_readme_hypercorn_command_drains_on_a_process_group_sigterm(tiny_llama_dir) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ, "SLUICE_MODEL": str(tiny_llama_dir), "SLUICE_DTYPE": "float32", "SLUICE_NUM_THREADS": "1",
        "SLUICE_NUM_KV_BLOCKS": "256", "SLUICE_MAX_NUM_SEQS": "8", "SLUICE_MAX_NUM_BATCHED_TOKENS": "256",
        "SLUICE_SERVED_MODEL_NAME": MODEL, "SLUICE_DRAIN_TIMEOUT": "1",
    }  # fmt: skip
    hypercorn = str(Path(sys.executable).parent / "hypercorn")
    command = [hypercorn, "--config", "web/hypercorn.toml", "--bind", f"127.0.0.1:{port}", "web.asgi:create_asgi_app()"]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)  # fmt: skip
    try:
        wait_until(lambda: health(base_url)[0] == 200 or process.poll() is not None, timeout=120)
        assert process.poll() is None
        with ThreadPoolExecutor(2) as pool:
            slow = {**LONG, "max_tokens": 480}
            bodies = (slow, {**SHORT, "max_tokens": 20})
            answered = [threading.Event() for _ in bodies]
            futures = [pool.submit(read_stream, base_url, body, seen) for body, seen in zip(bodies, answered)]
            # both streams answered first: a request still in the socket when Hypercorn stops accepting is
            # dropped by Hypercorn, whatever the app does
            wait_until(lambda: all(seen.is_set() for seen in answered), timeout=10)
            os.killpg(process.pid, signal.SIGTERM)  # what systemd and container runtimes send
            results = [f.result(timeout=30) for f in futures]
        for events in results:
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            assert events[-2]["choices"][0]["finish_reason"] in ("length", "abort")
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_a_model_it_refuses_ends_the_server_with_one_line_that_says_why(tmp_path: Path) -> None:
    """A file that is not a model (here: not GGUF at all) is a mistake to name, not a crash to trace."""
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file" * 8)
    command = [sys.executable, "-m", "web.server", "--model", str(junk), "--port", str(free_port())]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    log = done.stdout + done.stderr
    assert "the model did not load: cannot read" in log and "junk.gguf as a GGUF file" in log
    assert "Traceback" not in log
