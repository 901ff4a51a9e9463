"""Disconnects, admission bursts, engine failures and drain, against a real Hypercorn server (tiny model)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.support.lifecycle import LONG, MODEL, SHORT, engine_idle, metric
from tests.support.server_harness import (
    REPO,
    ThreadedServer,
    free_port,
    health,
    llm_engine_loader,
    parse_sse,
    reaped,
    server_subprocess,
    slowed,
    stream_request,
    tiny_engine_config,
    wait_until,
    wrapped_execute,
)


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> Iterator[ThreadedServer]:
    config = tiny_engine_config(tiny_llama_dir, max_num_seqs=2, max_num_batched_tokens=64)
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL, max_pending=4) as server:
        yield server


@pytest.fixture
def http(server: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client
    wait_until(lambda: engine_idle(server.base_url), timeout=30)


def read_some_then_leave(http: httpx.Client, body: dict[str, Any], num_lines: int) -> None:
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for i, _ in enumerate(response.iter_lines()):
            if i >= num_lines:
                break  # leaving the block closes the connection mid-stream


def test_disconnect_mid_stream_aborts_and_frees_blocks(server: ThreadedServer, http: httpx.Client) -> None:
    aborted_before = metric(server.base_url, "sluice_requests_aborted_total")
    with wrapped_execute(server.engine, slowed(0.005)):
        read_some_then_leave(http, LONG, num_lines=6)
        wait_until(lambda: metric(server.base_url, "sluice_requests_aborted_total") == aborted_before + 1, timeout=10)
        wait_until(lambda: engine_idle(server.base_url), timeout=10)
    assert http.post("/v1/completions", json=SHORT).json()["choices"][0]["finish_reason"] == "length"


def test_non_streaming_client_that_leaves_is_aborted(server: ThreadedServer, http: httpx.Client) -> None:
    aborted_before = metric(server.base_url, "sluice_requests_aborted_total")
    with wrapped_execute(server.engine, slowed(0.005)):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.base_url}/v1/completions", json=LONG, timeout=0.3)
        wait_until(lambda: metric(server.base_url, "sluice_requests_aborted_total") == aborted_before + 1, timeout=10)
        wait_until(lambda: engine_idle(server.base_url), timeout=10)
    assert http.post("/v1/completions", json=SHORT).json()["choices"][0]["finish_reason"] == "length"


def test_disconnect_while_queued_is_dropped(server: ThreadedServer, http: httpx.Client) -> None:
    aborted_before = metric(server.base_url, "sluice_requests_aborted_total")
    with wrapped_execute(server.engine, slowed(0.01)), ThreadPoolExecutor(4) as pool:
        blockers = [pool.submit(stream_request, http, "/v1/completions", {**LONG, "max_tokens": 150}) for _ in range(2)]
        wait_until(lambda: health(server.base_url)[1]["running"] == 2)
        queued_gone = threading.Event()

        def queued_then_leave() -> None:
            with httpx.Client(base_url=server.base_url, timeout=30) as other:
                with other.stream("POST", "/v1/completions", json={**SHORT, "stream": True}) as response:
                    assert response.status_code == 200
                    queued_gone.wait(10)

        leaver = pool.submit(queued_then_leave)
        wait_until(lambda: health(server.base_url)[1]["pending"] == 1)
        queued_gone.set()
        leaver.result()
        wait_until(lambda: health(server.base_url)[1]["pending"] == 0, timeout=10)
        assert metric(server.base_url, "sluice_requests_aborted_total") == aborted_before + 1
        assert health(server.base_url)[1]["running"] == 2  # the dropped request never reached the scheduler
        for blocker in blockers:
            assert blocker.result().events[-2]["choices"][0]["finish_reason"] == "length"
    wait_until(lambda: engine_idle(server.base_url), timeout=10)
    assert http.post("/v1/completions", json=SHORT).status_code == 200


def test_burst_beyond_max_pending_gets_429s_and_the_rest_complete(server: ThreadedServer, http: httpx.Client) -> None:
    rejected_before = metric(server.base_url, "sluice_requests_rejected_total")
    with wrapped_execute(server.engine, slowed(0.02)), ThreadPoolExecutor(12) as pool:
        blockers = [pool.submit(stream_request, http, "/v1/completions", {**LONG, "max_tokens": 100}) for _ in range(2)]
        wait_until(lambda: health(server.base_url)[1]["running"] == 2)
        responses = list(pool.map(lambda _: http.post("/v1/completions", json=SHORT), range(10)))
        for blocker in blockers:
            assert blocker.result().events[-1] == "[DONE]"
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 4 + [429] * 6  # max_pending = 4; the scheduler (max_num_seqs = 2) is full
    for response in responses:
        if response.status_code == 429:
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["type"] == "rate_limit_error"
        else:
            assert response.json()["choices"][0]["finish_reason"] == "length"
    assert metric(server.base_url, "sluice_requests_rejected_total") == rejected_before + 6


def test_forward_pass_failure_ends_each_open_stream_with_one_error(server: ThreadedServer, http: httpx.Client) -> None:
    fail_next = threading.Event()

    def failing(execute: Callable) -> Callable:
        def maybe_fail(plan: Any) -> Any:
            time.sleep(0.005)
            if fail_next.is_set():
                fail_next.clear()
                raise RuntimeError("injected forward-pass failure")
            return execute(plan)

        return maybe_fail

    with wrapped_execute(server.engine, failing), ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(stream_request, http, "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 400,
            "temperature": 0, "ignore_eos": True,
        }) for i in range(2)]  # fmt: skip
        wait_until(lambda: health(server.base_url)[1]["running"] == 2)
        fail_next.set()
        results = [s.result(timeout=30) for s in streams]
    for result in results:
        events = result.events
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        errors = [e for e in events[:-1] if "error" in e]
        assert len(errors) == 1 and events[-2] is errors[0]
        assert "injected" not in errors[0]["error"]["message"]  # no internals leak to the client
        assert errors[0]["error"]["type"] == "server_error"
        assert not any(c["choices"] and c["choices"][0]["finish_reason"] for c in events[:-2])
    assert http.post("/v1/completions", json=SHORT).status_code == 200
    assert health(server.base_url)[0] == 200


def test_engine_loop_crash_errors_every_stream_and_stops_the_server(tiny_llama_dir) -> None:
    config = tiny_engine_config(tiny_llama_dir)
    server = ThreadedServer(llm_engine_loader(config), served_model_name=MODEL)
    with server:
        engine = server.engine
        crash = threading.Event()
        real_finish_step = engine.finish_step

        def finish_step(plan: Any, sampled: Any) -> Any:
            if crash.is_set():
                raise RuntimeError("scheduler bookkeeping bug")
            return real_finish_step(plan, sampled)

        with wrapped_execute(engine, slowed(0.005)), ThreadPoolExecutor(3) as pool:
            engine.finish_step = finish_step
            http = httpx.Client(base_url=server.base_url, timeout=30)
            streams = [pool.submit(stream_request, http, "/v1/completions", LONG) for _ in range(3)]
            wait_until(lambda: health(server.base_url)[1].get("running", 0) >= 2)
            crash.set()
            results = [s.result(timeout=30) for s in streams]
        for result in results:
            assert result.events[-1] == "[DONE]"
            message = result.events[-2]["error"]["message"]
            assert "engine failed" in message and "bookkeeping" not in message
        assert server.stop() == 1  # serve() reports the crash: `python -m web.server` exits 1


# SIGINT: Ctrl-C; SIGHUP: a closed terminal, a reload
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_sigterm_drains_in_flight_streams_then_exits_zero(tiny_llama_dir, signum: signal.Signals) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    process = server_subprocess(
        ["--model", str(tiny_llama_dir), "--dtype", "float32", "--port", str(port), "--served-model-name", MODEL,
         "--num-kv-blocks", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "256"],
        env_overrides={"SLUICE_DRAIN_TIMEOUT": "0.5", "SLUICE_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        wait_until(lambda: health(base_url)[0] == 200 or process.poll() is not None, timeout=120)
        assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
        http = httpx.Client(base_url=base_url, timeout=60)
        first_events = [threading.Event() for _ in range(6)]

        def stream(i: int) -> list[Any]:
            body = {**LONG, "prompt": f"stream {i}", "max_tokens": 5 if i < 2 else 480, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                first = next(lines)
                first_events[i].set()
                events, _ = parse_sse(iter([first, *lines]))
                return events

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(stream, i) for i in range(6)]
            for event in first_events:
                assert event.wait(60)
            process.send_signal(signum)
            wait_until(lambda: health(base_url)[1].get("state") != "ready", timeout=10)
            late = http.post("/v1/completions", json=SHORT)
            assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
            results = [f.result(timeout=30) for f in futures]
        for events in results:
            assert events[-1] == "[DONE]"
            assert events[-2]["choices"][0]["finish_reason"] in ("length", "abort")
        assert {e[-2]["choices"][0]["finish_reason"] for e in results[:2]} == {"length"}
        assert process.wait(timeout=30) == 0
        log = process.stdout.read().decode() if process.stdout else ""
        assert f"{signum.name}: draining" in log and "again" not in log  # one signal is one drain, not a second signal
        drained = re.search(r"drain: (\d+) of (\d+) requests in flight finished, (\d+) ended with finish_reason "
                            r"'abort' at drain_timeout \(0.5 s\)", log)  # fmt: skip
        num_aborted = sum(e[-2]["choices"][0]["finish_reason"] == "abort" for e in results)
        assert drained and int(drained[3]) == num_aborted and int(drained[1]) + num_aborted == int(drained[2]), log
        assert log.rstrip().endswith("stopped: exit 0"), log[-500:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def catches(pid: int, signum: signal.Signals) -> bool:
    """Whether the process has a handler of its own for signum (its SigCgt mask in /proc)."""
    with open(f"/proc/{pid}/status") as status:
        mask = next(line for line in status if line.startswith("SigCgt:")).split()[1]
    return bool(int(mask, 16) >> (signum - 1) & 1)


def launcher_command(launcher: str, model: Path, port: int) -> list[str]:
    if launcher == "hypercorn":  # the README's command; the model from SLUICE_MODEL
        factory = "web.asgi:create_asgi_app()"
        bind = f"127.0.0.1:{port}"
        return [sys.executable, "-m", "hypercorn", "--config", "web/hypercorn.toml", "--bind", bind, factory]
    module = ["web.cli", "serve"] if launcher == "sluice serve" else ["web.server"]
    return [sys.executable, "-m", *module, "--model", str(model), "--port", str(port)]


@pytest.mark.parametrize("launcher", ["sluice serve", "web.server", "hypercorn"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_while_the_server_starts_ends_it_with_one_line_and_exit_zero(tiny_llama_dir, signum, launcher) -> None:
    """From the first import of Sluice to the server's own handlers: SIGTERM and SIGHUP killed the process by the
    signal (exit -15, -1), SIGINT printed a KeyboardInterrupt traceback (or aborted inside torch's import); under
    `python -m web.server` and the hypercorn command, until their imports (torch's among them) were done."""
    command = launcher_command(launcher, tiny_llama_dir, free_port())
    env = {**os.environ, "SLUICE_MODEL": str(tiny_llama_dir)}
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        wait_until(lambda: process.poll() is not None or catches(process.pid, signal.SIGTERM), timeout=30, interval=0.005)
        process.send_signal(signum)
        assert process.wait(timeout=30) == 0
        log = process.stdout.read().decode()
        assert log.strip().endswith(f"{signum.name}: stopped before the server started") and "Traceback" not in log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_while_an_idle_server_exits_does_not_kill_it(tiny_llama_dir, second) -> None:
    """An idle drain ends in milliseconds, and the interpreter's teardown after it (Python's handlers reset to the
    defaults) took the second Ctrl-C as a kill: exit -2, once a traceback."""
    port = free_port()
    command = [sys.executable, "-m", "web.cli", "serve", "--model", str(tiny_llama_dir), "--port", str(port)]
    env = {**os.environ, "SLUICE_ACCESS_LOG": "false"}
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    with reaped(process):
        wait_until(lambda: health(f"http://127.0.0.1:{port}")[0] == 200 or process.poll() is not None, timeout=120)
        process.send_signal(signal.SIGINT)
        time.sleep(0.15)
        process.send_signal(second)
        assert process.wait(timeout=30) == 0
        log = process.stdout.read().decode()
        assert "SIGINT: draining" in log and "Traceback" not in log


# The server with every forward pass 50 ms slower, so that streams are still running when the signals come.
SLOW_SERVER = """
import sys, time
from engine.llm_engine import LLMEngine
execute = LLMEngine.execute
LLMEngine.execute = lambda self, plan: (time.sleep(0.05), execute(self, plan))[1]
from web.server import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_second_sigterm_ends_every_stream_now_and_exits_zero(tiny_llama_dir) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-c", SLOW_SERVER, "--model", str(tiny_llama_dir), "--dtype", "float32", "--port", str(port),
         "--served-model-name", MODEL, "--num-kv-blocks", "256", "--max-num-seqs", "8"],
        cwd=REPO, env={**os.environ, "SLUICE_DRAIN_TIMEOUT": "120", "SLUICE_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(lambda: health(base_url)[0] == 200 or process.poll() is not None, timeout=120)
        assert process.poll() is None
        http = httpx.Client(base_url=base_url, timeout=60)
        first_events = [threading.Event() for _ in range(4)]

        def stream(i: int) -> list[Any]:
            with http.stream("POST", "/v1/completions", json={**LONG, "prompt": f"stream {i}", "stream": True}) as r:
                lines = r.iter_lines()
                first = next(lines)
                first_events[i].set()
                return parse_sse(iter([first, *lines]))[0]

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(stream, i) for i in range(4)]
            for event in first_events:
                assert event.wait(60)
            process.send_signal(signal.SIGTERM)  # drains for up to 120 s: 480 tokens take ~24 s here
            wait_until(lambda: health(base_url)[1].get("state") == "draining", timeout=10)
            process.send_signal(signal.SIGTERM)
            second_at = time.monotonic()
            results = [f.result(timeout=30) for f in futures]
            assert process.wait(timeout=30) == 0
        assert time.monotonic() - second_at < 15  # not the drain's 120 s, nor the streams' ~24 s
        for events in results:
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_stop_writes_out_a_slow_readers_finished_stream(tiny_llama_dir) -> None:
    """The engine has finished a stream whose client has not read it (kilobytes of buffers on both sides, ~100 KB
    of events): stopping the server waits for the bytes to be written (within drain_timeout) instead of giving
    Hypercorn graceful_timeout and exiting with them still in the transport, which cut the stream mid-line."""
    config = tiny_engine_config(tiny_llama_dir)
    overrides = {"served_model_name": MODEL, "drain_timeout": 20.0, "graceful_timeout": 0.5}
    with ThreadedServer(llm_engine_loader(config), send_buffer_bytes=4096, **overrides) as server:
        body = orjson.dumps({**LONG, "max_tokens": 200, "logprobs": 5, "stream": True})
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", server.config.port))
            head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            time.sleep(1.0)  # the request arrives, and the tiny model generates it in well under a second
            wait_until(lambda: engine_idle(server.base_url))
            stopping = threading.Thread(target=server.stop)
            stopping.start()
            time.sleep(2.0)  # past graceful_timeout: before the fix the process had dropped the unwritten bytes
            received = b"".join(iter(lambda: sock.recv(65536), b""))
            stopping.join(30)
    assert received.startswith(b"HTTP/1.1 200") and len(received) > 50_000
    assert received.rstrip(b"\r\n0").endswith(b"data: [DONE]"), received[-300:]


# The server with a load that never ends (a stand-in for a large file, or a file whose metadata keeps it busy),
# and logs as it goes.
ENDLESS_LOAD_SERVER = """
import logging, sys, time
from engine import llm_engine
def endless(self, config):
    while True:
        logging.getLogger("engine.loader").warning("still loading")
        time.sleep(0.02)
llm_engine.LLMEngine.__init__ = endless
from web.server import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_while_the_model_loads_exits_zero_without_waiting_for_the_load(tiny_llama_dir) -> None:
    """The drain had nothing to wait for, but the exit waited for the load's thread: a server killed only by
    SIGKILL (a file with 2^32 layers kept its load busy for good)."""
    port = free_port()
    command = [sys.executable, "-c", ENDLESS_LOAD_SERVER, "--model", str(tiny_llama_dir), "--port", str(port)]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    with reaped(process):
        wait_until(lambda: health(f"http://127.0.0.1:{port}")[0] == 503 or process.poll() is not None, timeout=60)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        log = process.stdout.read().decode()
        assert "stopped before the model had loaded" in log and "Traceback" not in log
        # the abandoned load's thread runs on until the exit, but is heard no more
        assert "still loading" in log.split("SIGTERM")[0]
        assert "still loading" not in log.split("stopped before the model had loaded")[1], log


def test_loading_answers_503_until_the_engine_is_ready(tiny_llama_dir) -> None:
    release = threading.Event()
    load = llm_engine_loader(tiny_engine_config(tiny_llama_dir))

    def slow_load() -> Any:
        release.wait(30)
        return load()

    with ThreadedServer(slow_load, served_model_name=MODEL, wait_ready=False) as server:
        wait_until(lambda: health(server.base_url)[0] == 503)
        assert health(server.base_url)[1]["state"] == "loading"
        response = httpx.post(f"{server.base_url}/v1/completions", json=SHORT)
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_loading"
        assert response.headers["Retry-After"] == "1"  # loading ends by itself
        release.set()
        wait_until(lambda: health(server.base_url)[0] == 200)
        assert httpx.post(f"{server.base_url}/v1/completions", json=SHORT, timeout=30).status_code == 200


def test_the_hypercorn_command_serves_and_stops_cleanly(tiny_llama_dir, tmp_path) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ, "SLUICE_MODEL": str(tiny_llama_dir), "SLUICE_DTYPE": "float32", "SLUICE_NUM_THREADS": "1",
        "SLUICE_NUM_KV_BLOCKS": "256", "SLUICE_MAX_NUM_SEQS": "8", "SLUICE_MAX_NUM_BATCHED_TOKENS": "256",
        "SLUICE_SERVED_MODEL_NAME": MODEL,
    }  # fmt: skip
    command = [sys.executable, "-m", "hypercorn", "--config", "web/hypercorn.toml", "--bind", f"127.0.0.1:{port}",
               "web.asgi:create_asgi_app()"]  # fmt: skip
    log = tmp_path / "hypercorn.log"
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    try:
        wait_until(lambda: health(base_url)[0] == 200 or process.poll() is not None, timeout=120)
        result = stream_request(httpx.Client(base_url=base_url, timeout=30), "/v1/completions", SHORT)
        assert result.events[-1] == "[DONE]" and result.events[-2]["choices"][0]["finish_reason"] == "length"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        lines = log.read_text().splitlines()
        assert sum("Running on" in line for line in lines) == 1, lines[:5]  # hypercorn's line, once
        assert any("sluice.server: engine ready" in line for line in lines)  # ours, through the root's handler
        # what sluice serve sets on its binds, set by the app on Hypercorn's (client_read_timeout's default 30 s)
        limits = f"connections accepted on 127.0.0.1:{port}: send buffer 128 KiB, unacknowledged for at most 30 s"
        assert sum(limits in line for line in lines) == 1, lines[:5]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
