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
import pytest

from tests.support.hang_server import HANG_TEMPERATURE
from tests.support.lifecycle import LONG, MODEL, SHORT
from tests.support.server_harness import REPO, free_port, health, parse_sse, wait_until


TINY_ARGS = ["--dtype", "float32", "--served-model-name", MODEL, "--num-kv-blocks", "256", "--max-num-seqs", "8",
             "--max-num-batched-tokens", "256", "--num-threads", "1"]  # fmt: skip
HANG = {**SHORT, "temperature": HANG_TEMPERATURE, "max_tokens": 5}


def start_hang_server(model_dir: Path, port: int, **env: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "tests.support.hang_server", "--model", str(model_dir), "--port", str(port),
               *TINY_ARGS]
    env = {**os.environ, "SLUICE_ACCESS_LOG": "false", **env}  # a pipe no one reads until a failure: no line per poll
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


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


# The README's hypercorn command with every forward pass 50 ms slower, so that a long stream outlasts the drain.
SLOW_HYPERCORN = """
import sys, time
from engine.llm_engine import LLMEngine
execute = LLMEngine.execute
LLMEngine.execute = lambda self, plan: (time.sleep(0.05), execute(self, plan))[1]
from hypercorn.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(("target", "signum"), [("process", signal.SIGTERM), ("group", signal.SIGTERM),
                                               ("process", signal.SIGHUP)])  # fmt: skip
def test_the_readme_hypercorn_command_drains_on_sigterm(tiny_llama_dir, target: str, signum: signal.Signals) -> None:
    """A SIGTERM to the process (docker stop, kill PID) or to its group (systemd, Ctrl-C) drains: new requests
    get 503, a stream longer than drain_timeout ends with "abort" and [DONE], the process exits 0. A SIGHUP the
    same (Hypercorn has no handler of its own for it: the process stayed up, answering 503)."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ, "SLUICE_MODEL": str(tiny_llama_dir), "SLUICE_DTYPE": "float32", "SLUICE_NUM_THREADS": "1",
        "SLUICE_NUM_KV_BLOCKS": "256", "SLUICE_MAX_NUM_SEQS": "8", "SLUICE_MAX_NUM_BATCHED_TOKENS": "256",
        "SLUICE_SERVED_MODEL_NAME": MODEL, "SLUICE_DRAIN_TIMEOUT": "2",
    }  # fmt: skip
    command = [sys.executable, "-c", SLOW_HYPERCORN, "--config", "web/hypercorn.toml", "--bind", f"127.0.0.1:{port}",
               "web.asgi:create_asgi_app()"]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)  # fmt: skip
    try:
        wait_until(lambda: health(base_url)[0] == 200 or process.poll() is not None, timeout=120)
        assert process.poll() is None
        with ThreadPoolExecutor(1) as pool:
            answered = threading.Event()
            future = pool.submit(read_stream, base_url, {**LONG, "max_tokens": 480}, answered)  # ~24 s of steps
            assert answered.wait(30)
            if target == "group":
                os.killpg(process.pid, signum)
            else:
                process.send_signal(signum)
            sent = time.monotonic()
            wait_until(lambda: health(base_url)[1].get("state") == "draining", timeout=5)
            events = future.result(timeout=30)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert events[-2]["choices"][0]["finish_reason"] == "abort"
        assert process.wait(timeout=30) == 0
        assert time.monotonic() - sent < 15  # the drain's 2 s and the exit, not the stream's ~24 s
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_the_hypercorn_command_exits_1_when_the_engine_cannot_start(tmp_path: Path) -> None:
    """A supervisor restarts what exits non-zero: under the hypercorn command too (its workers' codes are lost)."""
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file" * 8)
    hypercorn = str(Path(sys.executable).parent / "hypercorn")
    command = [hypercorn, "--config", "web/hypercorn.toml", "--bind", f"127.0.0.1:{free_port()}",
               "web.asgi:create_asgi_app()"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "SLUICE_MODEL": str(junk)}, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1 and "the model did not load" in done.stderr
    bad = subprocess.run(command, cwd=REPO, env={**os.environ, "SLUICE_MAX_NUM_SEQS": "0"}, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "configuration error: max_num_seqs must be a positive integer" in bad.stderr
    assert "Traceback" not in bad.stderr


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
