"""A real Hypercorn server on a free loopback port, run in a thread (or a subprocess) for the server tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
from anyio.from_thread import BlockingPortal, start_blocking_portal

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, ServerConfig
from web.app import create_app
from web.connection_limits import SEND_BUFFER_BYTES
from web.server import hypercorn_config, serve

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(
    predicate: Callable[[], bool],
    timeout: float = 60.0,
    interval: float = 0.02,
    describe: Callable[[], object] | None = None,
) -> None:
    """describe(): what the failure message shows of the state the predicate looked at."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached in time" + (f": {describe()}" if describe else ""))
        time.sleep(interval)


def health(base_url: str) -> tuple[int, dict[str, Any]]:
    try:
        response = httpx.get(f"{base_url}/health", timeout=5)
    except httpx.TransportError:
        return 0, {}
    return response.status_code, response.json()


class ThreadedServer:
    """Hypercorn + the engine loop in a thread of their own, with an event loop of their own."""

    def __init__(
        self,
        load_engine: Callable[[], Any],
        wait_ready: bool = True,
        send_buffer_bytes: int | None = None,
        **server_overrides: Any,
    ) -> None:
        """send_buffer_bytes: SO_SNDBUF of the listening socket (accepted sockets inherit it), so that a client
        that does not read fills the server's buffers after kilobytes instead of megabytes."""
        self.wait_ready = wait_ready
        self.send_buffer_bytes = send_buffer_bytes
        self.abandoned = threading.Event()  # a forward pass was left running (the test must release it)
        self.config = ServerConfig(port=free_port(), **server_overrides)
        self.base_url = f"http://127.0.0.1:{self.config.port}"
        self._loaded: list[Any] = []  # the core engine, once loaded: tests check its block pool

        def load_and_keep() -> Any:
            self._loaded.append(load_engine())
            return self._loaded[-1]

        self.async_engine = AsyncEngine(
            load_and_keep,
            max_pending=self.config.max_pending,
            step_timeout=self.config.step_timeout,
            client_read_timeout=self.config.client_read_timeout,
            on_forward_abandoned=self.abandoned.set,
        )
        self.app = create_app(self.async_engine, self.config)
        self._exit = ExitStack()
        self._portal: BlockingPortal | None = None
        self._stop: anyio.Event | None = None
        self._served: Future[int] | None = None

    def __enter__(self) -> ThreadedServer:
        self._portal = self._exit.enter_context(start_blocking_portal("asyncio"))
        self._stop = self._portal.call(anyio.Event)
        hconfig = hypercorn_config(self.config, self.send_buffer_bytes or SEND_BUFFER_BYTES)
        self._served = self._portal.start_task_soon(
            lambda: serve(self.async_engine, self.app, self.config, bind=hconfig, stop=self._stop)
        )
        expected = 200 if self.wait_ready else 503
        wait_until(lambda: health(self.base_url)[0] == expected or self._served.done())
        if self._served.done():
            self._served.result()
        return self

    @property
    def engine(self) -> Any:
        return self._loaded[-1]

    def stop(self, timeout: float = 30.0) -> int:
        assert self._portal is not None and self._stop is not None and self._served is not None
        if not self._served.done():
            self._portal.call(self._stop.set)
        return self._served.result(timeout)

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self.stop()
        finally:
            self._exit.close()


@contextmanager
def wrapped_execute(engine: Any, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    engine.execute = wrap(type(engine).execute.__get__(engine))
    try:
        yield
    finally:
        del engine.execute  # back to the class's method


@contextmanager
def reaped(process: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """The process, killed on the way out if a failed check left it running."""
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def slowed(seconds: float) -> Callable[[Callable], Callable]:
    def wrap(execute: Callable) -> Callable:
        def slow_execute(plan: Any) -> Any:
            time.sleep(seconds)  # runs in the worker thread, like the real forward pass
            return execute(plan)

        return slow_execute

    return wrap


def tiny_engine_config(model_dir: Path, **overrides: Any) -> EngineConfig:
    defaults: dict[str, Any] = dict(
        model=str(model_dir),
        dtype="float32",
        num_kv_blocks=256,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        num_threads=1,  # the tiny model gains nothing from more, and the tests share the CPU
    )
    return EngineConfig(**{**defaults, **overrides})


def llm_engine_loader(config: EngineConfig) -> Callable[[], Any]:
    def load() -> Any:
        from engine.llm_engine import LLMEngine

        return LLMEngine(config)

    return load


def server_subprocess(args: list[str], env_overrides: dict[str, str] | None = None) -> subprocess.Popen:
    # No access log: its line per /health poll would fill the pipe no one reads until a failure, and block the server.
    env = {**os.environ, "SLUICE_ACCESS_LOG": "false", **(env_overrides or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "web.server", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


@dataclass
class SSEStream:
    status: int
    headers: httpx.Headers
    events: list[Any]  # decoded JSON payloads, then the string "[DONE]"
    raw_lines: list[str]


def parse_sse(lines: Iterator[str]) -> tuple[list[Any], list[str]]:
    events: list[Any] = []
    raw: list[str] = []
    for line in lines:
        raw.append(line)
        if not line:
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        data = line[len("data: ") :]
        events.append("[DONE]" if data == "[DONE]" else orjson.loads(data))
    return events, raw


def stream_request(client: httpx.Client, path: str, body: dict[str, Any]) -> SSEStream:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            response.read()
            return SSEStream(response.status_code, response.headers, [response.json()], [])
        events, raw = parse_sse(response.iter_lines())
        return SSEStream(response.status_code, response.headers, events, raw)
