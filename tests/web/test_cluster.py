"""`sluice serve --replicas 2`: two engine replicas on a local Ray cluster (one compute thread each) behind the
front, on a small random model. One server for the module (Ray's start is slow), tests in order: the last three hang or
kill a replica and drain the front."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from tests.support.cluster_server import MODEL, START_TIMEOUT, ClusterServer
from tests.support.engine_helpers import make_llm
from tests.support.server_harness import health, parse_sse, wait_until
from tests.support.tiny_models import save_tiny_llama


pytest.importorskip("ray", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

SYSTEM = "You are a careful assistant. " * 12

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Llama (16M weights: ~30 ms a step of 8 rows on one thread) rather than the tiny one (1 ms a step):
    the front then writes hundreds of events a second rather than thousands, and a stream outlasts the admission
    of a burst on a busy 2-core machine, so that a fault lands on streams that are running."""
    return save_tiny_llama(tmp_path_factory.mktemp("small_llama"), hidden_size=512, intermediate_size=2048,
                           num_hidden_layers=4)  # fmt: skip


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterServer]:
    server = ClusterServer(model_dir, tmp_path_factory.mktemp("cluster") / "server.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.close()


def wait(cluster: ClusterServer, predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> None:
    """wait_until, whose failure shows how the front saw the replicas meanwhile: (time, routing decisions, each
    replica's (in flight, running, waiting)), the last 40 changes."""
    views: deque[tuple[float, Any, list[tuple[Any, ...]]]] = deque(maxlen=40)
    start = time.monotonic()

    def looked_at() -> bool:
        body = health(cluster.base_url)[1].get("replicas", {})
        replicas = [(r["in_flight"], r.get("running"), r.get("waiting")) for r in body.get("replicas", [])]
        if not views or views[-1][1:] != (body.get("decisions"), replicas):  # each change once
            views.append((round(time.monotonic() - start, 2), body.get("decisions"), replicas))
        return predicate()

    wait_until(looked_at, timeout, interval, describe=lambda: "\n".join(map(str, views)))


def idle(server: ClusterServer) -> bool:
    status, body = health(server.base_url)
    replicas = body.get("replicas", {}).get("replicas", [])
    return status == 200 and len(replicas) == 2 and all(
        r["ready"] and r["running"] == r["waiting"] == r["in_flight"] == 0 and r["free_kv_blocks"] == r["total_kv_blocks"]
        for r in replicas
    )


class Streams:
    """num_streams streams of body sent at once from one thread of their own (an event loop: sixteen reader threads
    would starve the test's own calls of the GIL for seconds), each followed from the client's side: how many
    have had their first event (the front admitted it, its replica runs it) and how many have ended."""

    def __init__(self, base_url: str, body: dict[str, Any], num_streams: int) -> None:
        self.num_streams = num_streams
        self.num_started = 0
        self.ended: list[tuple[int, list[Any]]] = []  # in the order they ended
        self._results: list[tuple[int, list[Any]]] | BaseException = []
        self._thread = threading.Thread(target=self._run, args=(base_url, {**body, "stream": True}), daemon=True)
        self._thread.start()

    def _run(self, base_url: str, body: dict[str, Any]) -> None:
        async def stream_all() -> list[tuple[int, list[Any]]]:
            limits = httpx.Limits(max_connections=self.num_streams)
            async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
                return await asyncio.gather(*(self._stream(client, body) for _ in range(self.num_streams)))

        try:
            self._results = asyncio.run(stream_all())
        except BaseException as error:  # noqa: BLE001  # results() raises it in the test's thread
            self._results = error

    async def _stream(self, client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, list[Any]]:
        result: tuple[int, list[Any]] = (0, [])
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    result = response.status_code, []
                    return result
                lines: list[str] = []
                async for line in response.aiter_lines():
                    if line and not lines:
                        self.num_started += 1
                    lines.append(line)
                result = 200, parse_sse(iter(lines))[0]
                return result
        finally:
            self.ended.append(result)

    def wait_all_running_on_both(self, cluster: ClusterServer) -> None:
        """Every stream has had its first event and none has ended, and the front has been seen with streams in
        flight on both replicas. The client's side decides when: the replicas' own reports are a poll old, while
        the client sees each stream start and end as it happens."""
        is_spread = False

        def ready() -> bool:
            nonlocal is_spread
            is_spread = is_spread or all(r["in_flight"] > 0 for r in cluster.replicas())  # once seen, not asked again
            return is_spread and self.num_started == self.num_streams or bool(self.ended)

        def describe() -> str:
            return f"{self.num_started} of {self.num_streams} started, {len(self.ended)} ended, spread seen: {is_spread}"

        wait_until(ready, timeout=30, interval=0.01, describe=describe)
        if self.ended:
            endings = [(status, len(events), events[-2:]) for status, events in self.ended]
            raise AssertionError(f"{describe()}: before all had started, these ended: {endings}")

    def results(self, timeout: float) -> list[tuple[int, list[Any]]]:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"streams still open after {timeout} s"
        if isinstance(self._results, BaseException):
            raise self._results
        return self._results


def terminal_events(events: list[Any]) -> list[Any]:
    """The events that end a stream: a chunk with a finish_reason, or an error."""
    return [e for e in events if isinstance(e, dict) and ("error" in e or any(c.get("finish_reason") for c in e["choices"]))]


def assert_some_failed_and_the_rest_finished(results: list[tuple[int, list[Any]]]) -> None:
    """The failed replica's streams end with one error event, the other replica's finish normally; each stream
    has exactly one terminal event, then [DONE]."""
    assert all(status == 200 for status, _ in results)
    ends = [terminal_events(events) for _, events in results]
    assert all(len(end) == 1 for end in ends), "exactly one terminal event per stream"
    assert all(events[-1] == "[DONE]" for _, events in results)
    failed = [end[0] for end in ends if "error" in end[0]]
    finished = [end[0] for end in ends if "error" not in end[0]]
    assert failed and finished, (len(failed), len(finished))
    assert all(e["choices"][0]["finish_reason"] == "length" for e in finished)


def wait_replaced(cluster: ClusterServer, victim: dict[str, Any]) -> None:
    """Ray Serve starts a replacement for the victim (its replica as the front saw it before the fault), which
    rejoins the routing (with an empty prefix memory)."""
    index = victim["index"]
    wait(cluster, lambda: cluster.replicas()[index]["ready"] and cluster.replicas()[index]["pid"] != victim["pid"],
         timeout=START_TIMEOUT, interval=1.0)  # fmt: skip
    assert cluster.replicas()[index]["restarts"] == victim["restarts"] + 1


def test_openai_client_streams_and_not_as_one_process(cluster: ClusterServer, model_dir: Path) -> None:
    from openai import OpenAI

    from engine.sampling_params import SamplingParams

    llm = make_llm(model_dir)

    client = OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = "The quick brown fox"
    expected = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].text
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    pieces = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(pieces)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello world"}],
                                          max_tokens=6, stream=True)  # fmt: skip
    chat_chunks = list(chat)
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert chat_chunks[-1].choices[0].finish_reason in ("stop", "length")
    # a grammar compiles on the replica too (its first, with llguidance's vocabulary, off the replica's loop)
    choice = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})  # fmt: skip
    assert choice.choices[0].text in ("yes", "no")
    wait(cluster, lambda: idle(cluster), timeout=10)


def test_a_vanished_client_frees_its_replicas_kv(cluster: ClusterServer) -> None:
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for i, _ in enumerate(response.iter_lines()):
                if i >= 4:
                    break  # leaving the block closes the connection mid-stream
        left_at = time.monotonic()
    wait(cluster, lambda: idle(cluster), timeout=10, interval=0.05)
    assert time.monotonic() - left_at < 10
    text = httpx.get(f"{cluster.base_url}/metrics").text
    assert "sluice_requests_aborted_total 1.0" in text


def test_affine_routing_keeps_each_conversation_on_one_replica(cluster: ClusterServer, model_dir: Path) -> None:
    """Six conversations of three turns, interleaved. A turn's cached tokens come from its replica's own prefix
    cache: every later turn finds there every full block its prompt shares with the conversation's earlier prompt
    (all of it, unless the tokenizer merged the earlier generation prompt's end with the reply's text now after
    it: then up to that token), so it went where its history is."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hits_before = sum(r["prefix_hits"] for r in cluster.replicas())
    num_cached = 0
    histories = {u: [{"role": "system", "content": SYSTEM}] for u in range(6)}
    previous_prompt: dict[int, list[int]] = {}
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        for turn in range(3):
            for user, messages in histories.items():
                messages.append({"role": "user", "content": f"User {user} asks question number {turn}."})
                prompt = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
                body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
                answer = client.post("/v1/chat/completions", json=body).json()
                usage = answer["usage"]
                assert usage["prompt_tokens"] == len(prompt)  # the server's tokens are these
                if turn:
                    earlier = previous_prompt[user]
                    shared = next((i for i, (a, b) in enumerate(zip(earlier, prompt)) if a != b), len(earlier))
                    # every full block (of 4) of the shared prefix
                    assert usage["prompt_tokens_details"]["cached_tokens"] >= shared // 4 * 4 > 0, (user, turn)
                previous_prompt[user] = prompt
                num_cached += usage["prompt_tokens_details"]["cached_tokens"]
                messages.append(answer["choices"][0]["message"])
    decisions = health(cluster.base_url)[1]["replicas"]["decisions"]
    assert decisions.get("prefix", 0) >= 12
    wait(cluster, lambda: idle(cluster), timeout=10)
    # The replicas' own counters agree: the hits are theirs (the front polls them, so give its figures a poll or two).
    replica_hits = lambda: sum(r["prefix_hits"] for r in cluster.replicas()) - hits_before  # noqa: E731
    with contextlib.suppress(TimeoutError):  # the assertion below then shows the figures
        wait(cluster, lambda: replica_hits() == num_cached, timeout=10)
    assert replica_hits() == num_cached


def test_every_replica_full_is_told_429_with_retry_after(cluster: ClusterServer) -> None:
    # Each replica takes max_num_seqs (16) running plus max_pending (8) queued: 48 places in all. 96 requests sent
    # at once from one event loop (threads would spread them over the time the model takes to answer a few).
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 100, "ignore_eos": True}

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=180,
                                     limits=httpx.Limits(max_connections=96)) as client:  # fmt: skip
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(96)))

    statuses = asyncio.run(send_all())
    rejected = [r for r in statuses if r.status_code == 429]
    assert rejected and all(r.headers["Retry-After"] for r in rejected)
    assert all(r.status_code in (200, 429) for r in statuses)
    wait(cluster, lambda: idle(cluster), timeout=30)


def test_a_hung_replica_leaves_the_routing_ends_its_streams_and_is_replaced(cluster: ClusterServer) -> None:
    """A replica process that stops answering altogether (SIGSTOP: its own watchdog cannot run either) leaves the
    routing at the front's next unanswered poll; Ray Serve's health check replaces it, and only its streams end
    with an error event."""
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 200, "ignore_eos": True}
    with httpx.Client(base_url=cluster.base_url, timeout=300) as client:
        victim = cluster.replicas()[1]
        streams = Streams(cluster.base_url, body, 8)
        streams.wait_all_running_on_both(cluster)
        os.kill(victim["pid"], signal.SIGSTOP)
        try:
            wait(cluster, lambda: not cluster.replicas()[1]["ready"], timeout=15, interval=0.2)
            answer = client.post("/v1/completions", json={**body, "max_tokens": 4})
            assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length"
            results = streams.results(timeout=300)
        finally:
            try:
                os.kill(victim["pid"], signal.SIGCONT)  # only if a failed assertion left it stopped
            except ProcessLookupError:
                pass
    assert_some_failed_and_the_rest_finished(results)
    wait_replaced(cluster, victim)
    wait(cluster, lambda: idle(cluster), timeout=30)


def test_a_killed_replica_ends_its_own_streams_and_the_other_finishes(cluster: ClusterServer) -> None:
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 200, "ignore_eos": True}
    with httpx.Client(base_url=cluster.base_url, timeout=120) as client:
        victim = cluster.replicas()[0]
        streams = Streams(cluster.base_url, body, 16)
        streams.wait_all_running_on_both(cluster)
        os.kill(victim["pid"], signal.SIGKILL)
        # Sent before the front can have noticed: those routed to the dead replica go to the living one.
        short = {**body, "max_tokens": 4}
        with ThreadPoolExecutor(8) as burst_pool:
            burst = [burst_pool.submit(client.post, "/v1/completions", json=short) for _ in range(8)]
            assert [f.result(timeout=120).status_code for f in burst] == [200] * 8
        results = streams.results(timeout=120)
        # At once, new requests go to the living replica.
        answer = client.post("/v1/completions", json={**body, "max_tokens": 4})
        assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length"
    assert_some_failed_and_the_rest_finished(results)
    wait_replaced(cluster, victim)
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        statuses = [client.post("/v1/completions", json={**body, "max_tokens": 2}).status_code for _ in range(4)]
    assert statuses == [200] * 4
    wait(cluster, lambda: idle(cluster), timeout=30)


def test_sigterm_drains_the_streams_on_every_replica(cluster: ClusterServer) -> None:
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 200, "ignore_eos": True}
    # both replicas ready and idle as the front sees them (after the kill-and-replace test, the replacement's load
    # is a poll away): else the streams may all go to one replica
    wait(cluster, lambda: idle(cluster), timeout=30)
    with httpx.Client(base_url=cluster.base_url, timeout=120) as client:
        # every request admitted (one that reaches the front after the signal is refused, 503, by design) and
        # both replicas streaming
        streams = Streams(cluster.base_url, body, 16)
        streams.wait_all_running_on_both(cluster)
        cluster.process.send_signal(signal.SIGTERM)
        results = streams.results(timeout=120)
    assert cluster.process.wait(120) == 0
    for status, events in results:
        assert status == 200 and events[-1] == "[DONE]"
        (end,) = terminal_events(events)
        assert end["choices"][0]["finish_reason"] == "length"
