"""The runner, client and report against an in-process OpenAI-style stub (httpx.MockTransport: no sockets)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time

import httpx
import pytest

from bench import report
from bench.cli import load_shapes, num_requests, parse_args, peer_target
from bench.client import RequestOptions, Target, build_body
from bench.runner import LoadShape, run_level
from bench.workload import LengthDist, build_workload, make_prompt

TARGET = Target("stub", "http://stub.test/v1", "m")


def sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


class Stub:
    """Every 5th request is refused with 429, every 7th ends in an error event; /health is optional."""

    def __init__(self, health: bool = True) -> None:
        self.counter = itertools.count(1)
        self.health = health
        self.bodies: list[dict] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"}) if self.health else httpx.Response(404)
        if path == "/metrics":
            n = len(self.bodies)  # one observation per request seen
            text = f'x_seconds_bucket{{le="0.1"}} {n}\nx_seconds_bucket{{le="+Inf"}} {n}\n'
            return httpx.Response(200, text=text) if self.health else httpx.Response(404)
        body = json.loads(request.content)
        self.bodies.append(body)
        n = next(self.counter)
        if n % 5 == 0:
            return httpx.Response(429, headers={"Retry-After": "1"}, json={"error": {"message": "queue full"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self.stream(body, n))

    async def stream(self, body: dict, n: int):
        chat = "messages" in body
        if chat:
            yield sse({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
        for i in range(body["max_tokens"]):
            await asyncio.sleep(0)
            piece = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
            if n % 7 == 0:
                yield sse({"error": {"message": "engine failed", "type": "server_error"}})
                yield b"data: [DONE]\n\n"
                return
            yield b": keep-alive\r\n\r\n" + sse({"choices": [{"index": 0, "finish_reason": None, **piece}]})
        yield sse({"choices": [{"index": 0, "delta": {}, "text": "", "finish_reason": "length"}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            yield sse({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": body["max_tokens"]}})
        yield b"data: [DONE]\n\n"


def specs(n: int = 20, output: str = "uniform:1:6"):
    return build_workload(n, LengthDist.parse("8"), LengthDist.parse(output), seed=3)


@pytest.mark.parametrize("shape", [LoadShape("closed", 4), LoadShape("burst", 20), LoadShape("rate", 2000.0)])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_request_is_accounted_for(shape: LoadShape, endpoint: str) -> None:
    stub = Stub()
    workload = specs()
    done = []
    result = asyncio.run(
        run_level(TARGET, workload, shape, RequestOptions(endpoint=endpoint), 0.001, done.append, httpx.MockTransport(stub))
    )
    s = result.summary()
    assert s["sent"] == len(done) == len(workload) == 20
    assert (s["completed"], s["rejected_429"], s["errors"]) == (14, 4, 2)  # 4 multiples of 5, 2 of 7 (not 35)
    ok = [r for r in result.requests if r.outcome == "ok"]
    assert all(r.usage_reported and r.finish_reason == "length" for r in ok)
    assert s["completion_tokens"] == sum(workload[r.index].max_tokens for r in ok)
    assert s["prompt_tokens"] == 11 * 14
    assert s["itl_s"]["n"] == sum(workload[r.index].max_tokens - 1 for r in ok)
    assert all(r.admission is not None for r in result.requests)
    assert s["health_s"]["n"] >= 1
    assert s["server_histograms"]["x_seconds"]["count"] == 20
    assert all(body["stream"] and body["ignore_eos"] and body["model"] == "m" for body in stub.bodies)


def test_without_usage_tokens_are_counted_from_events_and_missing_health_records_nothing() -> None:
    stub = Stub(health=False)
    options = RequestOptions(include_usage=False)
    result = asyncio.run(run_level(TARGET, specs(4, "3"), LoadShape("closed", 2), options, 0.001, None,
                                   httpx.MockTransport(stub)))
    assert [r.completion_tokens for r in result.requests] == [3, 3, 3, 3]
    assert not any(r.usage_reported for r in result.requests)
    assert result.health == [] and result.server_histograms == {}
    assert "stream_options" not in stub.bodies[0]


def test_connection_errors_are_errors() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    result = asyncio.run(run_level(TARGET, specs(3), LoadShape("closed", 1), RequestOptions(), None, None,
                                   httpx.MockTransport(refuse)))
    assert result.summary()["errors"] == 3
    assert all("ConnectError" in r.error for r in result.requests)


def test_request_bodies_per_flavor() -> None:
    spec = specs(1)[0]
    chat = build_body(TARGET, spec, RequestOptions())
    assert chat["messages"] == [{"role": "user", "content": spec.prompt}] and chat["ignore_eos"] is True
    hf = build_body(Target("tf", "http://x", "dir", "transformers"), spec, RequestOptions(endpoint="completions"))
    assert hf["prompt"] == spec.prompt and "ignore_eos" not in hf
    assert json.loads(hf["generation_config"]) == {"max_new_tokens": spec.max_tokens, "do_sample": False}
    plain = build_body(Target("x", "http://x"), spec, RequestOptions(ignore_eos=False, include_usage=False))
    assert {"model", "ignore_eos", "stream_options"}.isdisjoint(plain)


def test_length_distributions() -> None:
    rng = random.Random(0)
    assert LengthDist.parse("128").sample(rng) == 128
    uniform = LengthDist.parse("uniform:10:20")
    assert all(10 <= uniform.sample(rng) <= 20 for _ in range(200))
    assert all(LengthDist.parse(spec).sample(rng) >= 1 for spec in ("normal:2:50", "exp:3") for _ in range(200))
    assert str(LengthDist.parse("normal:128:32")) == "normal:128:32" and str(LengthDist.parse("64")) == "64"
    for bad in ("zipf:3", "uniform:5", "uniform:9:3", "0", "exp:x"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_workload_is_deterministic_and_prompts_hit_the_token_target() -> None:
    a = build_workload(5, LengthDist.parse("uniform:5:50"), LengthDist.parse("16"), seed=1, shared_prefix=4)
    assert a == build_workload(5, LengthDist.parse("uniform:5:50"), LengthDist.parse("16"), seed=1, shared_prefix=4)
    assert len({spec.prompt.split()[:4] == a[0].prompt.split()[:4] for spec in a}) == 1
    assert all(len(spec.prompt.split()) == spec.prompt_tokens for spec in a)
    # A counter that sees two tokens in long words: the prompt is shortened until it matches.
    def counter(text: str) -> int:
        return sum(2 if len(word) > 5 else 1 for word in text.split())
    words = ["apple", "orange", "to", "mountain", "sun"] * 10
    assert counter(make_prompt(words, 20, counter)) == 20


def test_report_outputs(tmp_path) -> None:
    stub = Stub()
    levels = [
        asyncio.run(run_level(TARGET, specs(10), LoadShape("closed", c), RequestOptions(), 0.001, None,
                              httpx.MockTransport(stub)))
        for c in (1, 4)
    ]
    text = report.table(levels)
    assert "stub" in text and "c=4" in text and "TTFT ms" in text and "errors seen:" in text
    report.write_json(tmp_path / "out.json", levels, {"url": "x"})
    data = json.loads((tmp_path / "out.json").read_text())
    assert [lv["sent"] for lv in data["levels"]] == [10, 10] and len(data["levels"][0]["requests"]) == 10
    again, config = report.read_json(tmp_path / "out.json")
    assert config == {"url": "x"} and report.table(again) == text
    assert report.table(levels, markdown=True).splitlines()[1].startswith("| --- |")
    report.plot(tmp_path / "out.png", levels)
    assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_levels_and_peers() -> None:
    args = parse_args(["--sweep", "1,4,16"])
    assert [(s.mode, s.level) for s in load_shapes(args)] == [("closed", 1), ("closed", 4), ("closed", 16)]
    assert [num_requests(args, s) for s in load_shapes(args)] == [16, 16, 64]
    burst = parse_args(["--burst"])
    assert [(s.mode, s.level) for s in load_shapes(burst)] == [("burst", 256)]
    assert num_requests(parse_args(["--num-requests", "2x"]), LoadShape("closed", 8)) == 16
    assert num_requests(parse_args(["--rate", "3"]), LoadShape("rate", 3)) == 64
    assert parse_args(["--from-json", "x.json", "--markdown"]).markdown
    assert peer_target("llama=http://127.0.0.1:9000") == Target("llama", "http://127.0.0.1:9000")
    assert peer_target("http://127.0.0.1:9000/v1").name == "127.0.0.1:9000"
    assert Target("x", "http://127.0.0.1:9000/v1/").root == "http://127.0.0.1:9000"


def test_focus_pauses_every_started_server_but_the_measured_one(tmp_path) -> None:
    import subprocess
    from pathlib import Path

    from bench import servers
    from bench.client import Target

    def stat_state(process: subprocess.Popen) -> str:
        return Path(f"/proc/{process.pid}/stat").read_text().split(") ")[1][0]

    def stopped(expected: list[bool]) -> list[bool]:
        """Which are stopped (T), waiting up to 10 s for `expected`: SIGSTOP/SIGCONT land when the process is scheduled."""
        deadline = time.monotonic() + 10
        while True:
            seen = [stat_state(s.process) == "T" for s in started.values()]
            if seen == expected or time.monotonic() > deadline:
                return seen
            time.sleep(0.02)

    started = {
        name: servers.ManagedServer(
            Target(name, "http://127.0.0.1:1"), subprocess.Popen(["sleep", "60"], start_new_session=True), tmp_path
        )
        for name in ("a", "b")
    }
    try:
        servers.focus(started, "a")
        assert stopped([False, True]) == [False, True]  # T: stopped
        servers.focus(started, None)
        assert stopped([False, False]) == [False, False]
        servers.focus(started, "b")
    finally:
        for server in started.values():
            servers.stop(server, grace=5)  # resumes a paused server so that SIGTERM ends it
    assert all(s.process.returncode is not None for s in started.values())


def test_a_request_the_server_dropped_unanswered_is_sent_once_more() -> None:
    stub = Stub()
    calls: list[int] = []

    async def drop_first_attempts(request: httpx.Request) -> httpx.Response:
        if request.method != "POST":
            return await stub(request)
        calls.append(1)
        if len(calls) % 2 == 1:  # every request is dropped the first time
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        return await stub(request)

    workload = specs(4, "3")
    result = asyncio.run(run_level(TARGET, workload, LoadShape("closed", 1), RequestOptions(), None, None,
                                   httpx.MockTransport(drop_first_attempts)))
    assert len(calls) == 8 and all(r.retried for r in result.requests)
    assert result.summary()["retried"] == 4 and [r.outcome for r in result.requests] == ["ok"] * 4

    def always_drop(request: httpx.Request) -> httpx.Response:
        if request.method != "POST":
            return httpx.Response(404)
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)

    result = asyncio.run(run_level(TARGET, specs(2), LoadShape("closed", 1), RequestOptions(), None, None,
                                   httpx.MockTransport(always_drop)))
    assert [r.outcome for r in result.requests] == ["error", "error"]  # only once more, then it is an error
    assert all(r.retried and "RemoteProtocolError" in r.error for r in result.requests)
