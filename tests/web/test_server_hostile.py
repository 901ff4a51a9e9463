"""What a hostile client gets from a real server (tiny model): extreme numbers, huge bodies, long stop lists,
clients that queue and vanish, clients that never read. Every case gets a clear error or a bounded cost, and
the server keeps serving everyone else."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest

from engine.config import ServerConfig
from web.asgi import raise_open_files_limit
from web.connection_limits import SEND_BUFFER_BYTES
from web.server import hypercorn_config

from tests.support.lifecycle import LONG, MODEL, SHORT, engine_idle, metric
from tests.support.server_harness import (
    REPO,
    ThreadedServer,
    free_port,
    health,
    llm_engine_loader,
    reaped,
    slowed,
    stream_request,
    tiny_engine_config,
    wait_until,
    wrapped_execute,
)

MAX_BODY_BYTES = 1 << 20
INF, NEG_INF = "INF", "-INF"  # written into the JSON text as 1e999 and -1e999, which overflow a double


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> Iterator[ThreadedServer]:
    config = tiny_engine_config(tiny_llama_dir, max_num_seqs=2, max_num_batched_tokens=64)
    options = dict(served_model_name=MODEL, max_pending=2, max_body_bytes=MAX_BODY_BYTES, client_read_timeout=1.0)
    with ThreadedServer(llm_engine_loader(config), send_buffer_bytes=16384, **options) as server:
        yield server


@pytest.fixture
def http(server: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client
    wait_until(lambda: engine_idle(server.base_url), timeout=30)


def raw_post(base_url: str, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    """POST over a plain socket that writes the whole body before reading: a reset shows up as an error."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    header, _, payload = data.partition(b"\r\n\r\n")
    return int(header.split()[1]), orjson.loads(payload)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": INF}, None),  # a number that overflows a double is not JSON the server accepts
        ({"repetition_penalty": NEG_INF}, None),
        ({"temperature": 3.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"max_tokens": 10**30}, "max_tokens"),  # parsed as a float: not an integer
        ({"max_tokens": 2**62}, "max_tokens"),
        ({"seed": 2**200}, "seed"),
        ({"min_tokens": 10**9, "max_tokens": None}, "min_tokens"),
        ({"stop": ["x"] * 10_000}, "stop"),
        ({"stop": ["y" * 100_000]}, "stop"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"prompt": [10**12]}, "prompt"),
        ({"prompt": "x" * (MAX_BODY_BYTES - 100)}, "prompt"),  # refused before any tokenization
        ({"prompt": ["a", "b", "c"]}, "prompt"),  # more prompts than max_pending (2)
        ({"prompt": ["a", "b"], "n": 2}, "n"),  # 4 sequences: one request may not hold more than the queue
        ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),  # past int()'s 4,300 digits
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "DEEP"}}}, None),
    ],
)
def test_values_that_cannot_be_honoured_get_a_400_naming_the_parameter(
    http: httpx.Client, fields: dict[str, Any], param: str | None
) -> None:
    deep = '{"anyOf": [' * 500 + '{"type": "string"}' + "]}" * 500  # JSON the parser takes, a schema walk cannot
    body = json.dumps({**SHORT, **fields}).replace('"INF"', "1e999").replace('"-INF"', "-1e999").replace('"DEEP"', deep)
    response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert http.post("/v1/completions", json=SHORT).status_code == 200


@pytest.mark.parametrize("field", ["seed", "max_tokens"])
def test_an_integer_past_64_bits_gets_a_400_that_says_so(http: httpx.Client, field: str) -> None:
    body = json.dumps({**SHORT, field: 0}).replace(f'"{field}": 0', f'"{field}": {2**70}')
    response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == f"{field}: Input should be an integer within 64 bits"


@pytest.mark.parametrize(
    "message, param, words",
    [
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
         "messages.0.content.0.type", "'text' or 'refusal', got 'image_url'"),
        ({"role": "user", "content": [{"type": "text"}]}, "messages.0.content.0.text", "Field required"),
        ({"role": "robot", "content": "hi"}, "messages.0.role", "got 'robot'"),
        ({"role": "user"}, "messages.0.content", "required in a message of role 'user'"),
        ({"role": "system", "content": None}, "messages.0.content", "required in a message of role 'system'"),
        ({"role": "assistant", "content": None}, "messages.0.content", "required in a message of role 'assistant'"),
        ({"role": "tool", "content": "18 degrees"}, "messages.0.tool_call_id", "required in a message of role 'tool'"),
    ],  # fmt: skip
)
def test_a_chat_message_the_server_cannot_take_gets_a_400_naming_its_part(
    http: httpx.Client, message: dict[str, Any], param: str, words: str
) -> None:
    """Content is a string or a list of text parts: a bad part is named, not reported as "not a string"."""
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [message], "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"tool_choice": {}}, "tool_choice.type", "Field required"),
        ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name", "Field required"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice.type", "got 'web_search'"),
        ({"messages": ["hi"]}, "messages.0", "Input should be a valid dictionary"),
        ({"stream_options": []}, "stream_options", "Input should be a valid dictionary"),
    ],  # fmt: skip
)
def test_a_400_names_the_field_as_the_request_spells_it_not_the_servers_class_for_it(
    http: httpx.Client, fields: dict[str, Any], param: str, words: str
) -> None:
    """A named tool choice is one member of a union: its fields were named "tool_choice.NamedToolChoice.type", and
    an object of the wrong type "a valid dictionary or instance of ChatMessage"."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"] and "instance of" not in error["message"], error


def test_an_assistant_refusal_part_is_read_as_its_text(http: httpx.Client) -> None:
    """OpenAI's assistant content parts are text or refusal (a client replays the refusals it got); vLLM reads a
    refusal part as its text. It was a 400 ("Input should be 'text'")."""
    def tokens(reply: Any) -> list[int]:
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": reply},
                    {"role": "user", "content": "why?"}]  # fmt: skip
        response = http.post("/tokenize", json={"model": MODEL, "messages": messages})
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    assert tokens([{"type": "refusal", "refusal": "I can't."}]) == tokens("I can't.")
    both = [{"type": "text", "text": "No"}, {"type": "refusal", "refusal": "I can't."}]
    assert tokens(both) == tokens("No\nI can't.")
    refused = {"role": "assistant", "content": [{"type": "refusal"}]}
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [refused], "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages.0.content.0.refusal"


@pytest.mark.parametrize(
    "fields",
    [
        {"top_p": 5e-324, "temperature": 1.0},  # a denormal that vanishes in float32
        {"temperature": 1e-300},
        {"temperature": 2.0, "top_k": 2**62, "min_p": 1e-320},
        {"repetition_penalty": 1e-45, "temperature": 1.0},  # overflows the penalised logits to inf
        {"repetition_penalty": 1e300, "presence_penalty": 2, "frequency_penalty": -2, "top_p": 1e-30},
        {"seed": 2**63 - 1, "temperature": 1.5, "top_p": 0.5},
        {"seed": -(2**63), "logprobs": 20, "temperature": 1.0},
    ],
)
def test_extreme_but_legal_sampling_values_always_yield_tokens(http: httpx.Client, fields: dict[str, Any]) -> None:
    body = {**SHORT, "max_tokens": 8, **fields, "prompt": "Hello world Hello world"}
    response = http.post("/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8


def test_the_largest_seed_with_n_choices_is_served(http: httpx.Client) -> None:
    """Choice i samples with seed + i: past 2^63 - 1 that failed the seed's check inside the engine loop, and the
    server shut down for everyone."""
    body = {**SHORT, "prompt": "Hello world", "max_tokens": 4, "temperature": 1.0, "seed": 2**63 - 1}
    response = http.post("/v1/completions", json={**body, "n": 2})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 2 and choices[0]["text"] == http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("seed", [2**63, 2**64 - 1, -(2**63) - 1, 2**200])
def test_a_seed_past_64_signed_bits_is_refused(http: httpx.Client, seed: int) -> None:
    """It was taken modulo 2^64: -1 and 2^64 - 1 gave the same output (vLLM takes a signed 64-bit seed)."""
    response = http.post("/v1/completions", json={**SHORT, "seed": seed})
    assert response.status_code == 400 and response.json()["error"]["param"] == "seed", response.text


@pytest.mark.parametrize("prompt", ["a" * (3 * MAX_BODY_BYTES), list(range(1_000_000))])
def test_a_body_over_the_limit_gets_a_readable_413(server: ThreadedServer, prompt: Any) -> None:
    status, body = raw_post(server.base_url, "/v1/completions", orjson.dumps({**SHORT, "prompt": prompt}))
    assert status == 413
    assert body["error"]["code"] == "request_too_large" and str(MAX_BODY_BYTES) in body["error"]["message"]


def test_health_stays_responsive_while_oversized_and_malformed_requests_are_rejected(server: ThreadedServer) -> None:
    bad_bodies = [
        orjson.dumps({**SHORT, "prompt": "z" * (MAX_BODY_BYTES - 200)}),  # 400 before tokenizing
        orjson.dumps({**SHORT, "prompt": list(range(100_000))}),
        orjson.dumps({**SHORT, "stop": ["s"] * 5_000}),
        b"{" * 10_000,
        orjson.dumps({**SHORT, "prompt": "q" * (2 * MAX_BODY_BYTES)}),  # 413
    ]
    stop = threading.Event()
    statuses: list[int] = []

    def abuse() -> None:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            while not stop.is_set():
                for body in bad_bodies:
                    response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                    statuses.append(response.status_code)

    latencies = []
    with ThreadPoolExecutor(3) as pool:
        abusers = [pool.submit(abuse) for _ in range(3)]
        with httpx.Client(base_url=server.base_url, timeout=30) as probe:
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                started = time.perf_counter()
                assert probe.get("/health").status_code == 200
                latencies.append(time.perf_counter() - started)
                time.sleep(0.01)
        stop.set()
        for abuser in abusers:
            abuser.result()
    # Requests being prepared hold admission slots: with max_pending 2 and three abusers, some are told 429 first.
    assert set(statuses) <= {400, 413, 429} and statuses.count(400) > 0 and statuses.count(413) > 0
    p99 = statistics.quantiles(latencies, n=100)[98]
    # A loose bound for a shared CI machine; bench/ measures the real figure (target: p99 under 50 ms).
    assert p99 < 0.5, f"/health p99 {p99 * 1000:.0f} ms while bad requests were rejected"


def test_queued_clients_that_vanish_free_their_slots_at_once(server: ThreadedServer, http: httpx.Client) -> None:
    with wrapped_execute(server.engine, slowed(0.01)), ThreadPoolExecutor(6) as pool:
        blockers = [pool.submit(stream_request, http, "/v1/completions", {**LONG, "max_tokens": 150}) for _ in range(2)]
        wait_until(lambda: health(server.base_url)[1]["running"] == 2)
        leave = threading.Event()

        def queue_then_vanish() -> None:
            with httpx.Client(base_url=server.base_url, timeout=30) as other:
                with other.stream("POST", "/v1/completions", json={**SHORT, "stream": True}) as response:
                    assert response.status_code == 200
                    leave.wait(10)

        leavers = [pool.submit(queue_then_vanish) for _ in range(2)]
        wait_until(lambda: health(server.base_url)[1]["pending"] == 2)
        assert http.post("/v1/completions", json=SHORT).status_code == 429  # max_pending = 2, all in use
        leave.set()
        for leaver in leavers:
            leaver.result()
        wait_until(lambda: health(server.base_url)[1]["pending"] == 0, timeout=5)
        admitted = pool.submit(http.post, "/v1/completions", json=SHORT)  # the freed slot takes it: no 429
        assert admitted.result().status_code == 200
        for blocker in blockers:
            assert blocker.result().events[-1] == "[DONE]"


def test_a_client_that_never_reads_is_aborted_and_disconnected(server: ThreadedServer) -> None:
    host, port = server.base_url.removeprefix("http://").split(":")
    body = orjson.dumps({**LONG, "stream": True, "logprobs": 20, "max_tokens": 480})  # ~4 kB per event
    aborted_before = metric(server.base_url, "sluice_requests_aborted_total")
    with wrapped_execute(server.engine, slowed(0.02)):  # 480 tokens would take 10 s
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        try:
            wait_until(lambda: health(server.base_url)[1]["running"] == 1, timeout=10)
            # client_read_timeout = 1 s: the request is aborted and its blocks freed although it never read (the
            # aborted count below tells that from a natural end; the wait is long for a loaded machine's slow steps).
            wait_until(lambda: engine_idle(server.base_url), timeout=20)
            assert metric(server.base_url, "sluice_requests_aborted_total") == aborted_before + 1
            # and the server's end of the connection goes, its queued output with it, though the client still
            # reads nothing (Hypercorn waited for that output to be written: open for as long as the client kept it)
            client_port = sock.getsockname()[1]
            wait_until(lambda: not open_tcp_connection(int(port), client_port), timeout=20)
            assert sock.recv(1 << 16).startswith(b"HTTP/1.1 200")
        finally:
            sock.close()


def open_tcp_connection(local_port: int, remote_port: int) -> bool:
    """Whether this machine has an IPv4 TCP socket from local_port to remote_port (in /proc/net/tcp, ports in hex)."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return any(int(row[1].split(":")[1], 16) == local_port and int(row[2].split(":")[1], 16) == remote_port
               for row in rows)  # fmt: skip


def test_a_chat_request_holds_no_more_choices_than_the_queue_holds_requests(http: httpx.Client) -> None:
    """As /v1/completions: n over max_pending (2) is refused (chat took n = 3 and held 3 sequences on one slot)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    refused = http.post("/v1/chat/completions", json={**body, "n": 3})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n", refused.text
    assert "n = 3: at most max_pending (2) sequences per request" in refused.json()["error"]["message"]
    assert len(http.post("/v1/chat/completions", json={**body, "n": 2}).json()["choices"]) == 2
    prompts = http.post("/v1/completions", json={**SHORT, "prompt": ["a", "b", "c"]}).json()["error"]["message"]
    assert prompts.startswith("3 prompts: at most max_pending (2)"), prompts  # was "3 prompts x n = 1" mid-change


def test_a_doubled_slash_is_a_json_404_not_a_redirect_to_the_clients_host(http: httpx.Client) -> None:
    response = http.post("/v1//completions", json=SHORT, headers={"host": "evil.example"})
    assert response.status_code == 404 and "location" not in response.headers
    assert response.json()["error"]["code"] == "not_found"


def raw_exchange(base_url: str, request: bytes) -> tuple[int, bytes, bytes]:
    """Sends bytes as they are (not necessarily HTTP) and reads to the end: status line's code, headers, body."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    header, _, body = data.partition(b"\r\n\r\n")
    return int(header.split()[1]), header.lower(), body


@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n", 431),  # over h11's 16 KiB
        (b"GET /v1/" + b"m" * 200_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431),
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64, 400),  # a TLS hello on the plain port
    ],
)
def test_a_request_hypercorn_refuses_before_the_app_gets_openais_error_shape(
    server: ThreadedServer, request_bytes: bytes, status: int
) -> None:
    got, header, body = raw_exchange(server.base_url, request_bytes)
    assert got == status and b"content-type: application/json" in header and b"connection: close" in header
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert status != 431 or "16384 bytes" in error["message"]
    assert health(server.base_url)[0] == 200

def test_thousands_of_empty_messages_are_refused_before_the_template(http: httpx.Client) -> None:
    for count, words in ((5_000, "5000 messages: more than the"), (10_000, "at most 8192 items")):
        messages = [{"role": "user", "content": ""}] * count
        started = time.monotonic()
        body = {"model": SHORT["model"], "messages": messages, "max_tokens": 2}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
        assert words in response.json()["error"]["message"] and time.monotonic() - started < 5


def test_accepted_connections_get_a_bounded_send_buffer_and_a_bounded_wait_for_acknowledgements() -> None:
    """A client that stops reading fills the buffer soon, so that client_read_timeout can end its request
    (autotuned, the kernel would queue up to 4 MB first); then the kernel drops its connection."""
    sockets = hypercorn_config(ServerConfig(port=free_port(), client_read_timeout=2.5)).create_sockets()
    (listener,) = sockets.insecure_sockets
    with listener:
        assert listener.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * SEND_BUFFER_BYTES  # Linux doubles it
        assert listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 2500


BOUND_SOCKETS = """
import socket
from engine.config import ServerConfig
from web.connection_limits import limit_bound_sockets
bound = socket.socket()
bound.bind(("127.0.0.1", 0))  # as Hypercorn's sockets are when it loads the app: bound, not yet listening
listener = socket.create_server(("127.0.0.1", 0))
client = socket.create_connection(listener.getsockname()); served, _ = listener.accept()
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.bind(("127.0.0.1", 0))
found = limit_bound_sockets(ServerConfig(client_read_timeout=2.5))
def limits(sock):
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
assert sorted(found) == sorted(f"127.0.0.1:{s.getsockname()[1]}" for s in (bound, listener)), found
assert [limits(s) for s in (bound, listener, client, served)] == [2500, 2500, 0, 0]
print("ok")
"""


def test_the_app_limits_the_sockets_the_hypercorn_command_bound_and_no_connection() -> None:
    """Under the hypercorn command Hypercorn binds before it loads the app: create_asgi_app sets on its sockets
    what sluice serve sets on its own (in a process of its own: it would set them on this one's servers too)."""
    out = subprocess.run([sys.executable, "-c", BOUND_SOCKETS], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_open_files_limit_is_raised_to_what_the_process_may_have() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        raise_open_files_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_path_cannot_write_lines_of_its_own_into_the_access_log(tiny_llama_dir, tmp_path) -> None:
    """A %0A in a URL reached the log decoded: a forged line, with whatever level and logger it spelled."""
    port, log = free_port(), tmp_path / "server.log"
    command = [sys.executable, "-m", "web.cli", "serve", "--model", str(tiny_llama_dir), "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "SLUICE_ACCESS_LOG": "true"})  # fmt: skip
    with reaped(process):
        wait_until(lambda: health(f"http://127.0.0.1:{port}")[0] == 200 or process.poll() is not None, timeout=120)
        forged = "/v1/models/x%0A2026-01-01%2000:00:00,000%20ERROR%20sluice.server:%20FORGED%0D%00"
        assert httpx.get(f"http://127.0.0.1:{port}{forged}").status_code == 404
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    lines = log.read_bytes().decode().splitlines()
    assert not any(line.startswith("2026-01-01") for line in lines) and "\x00" not in log.read_text()
    assert any("x\\x0a2026-01-01 00:00:00,000 ERROR sluice.server: FORGED\\x0d\\x00" in line for line in lines)
