"""A replicas front told to stop while Ray Serve starts, and by a signal to its whole process group: after the
cluster module's server has gone (a Ray of its own each)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.cluster_server import MODEL, START_TIMEOUT, ClusterServer
from tests.support.server_harness import free_port, parse_sse, wait_until

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


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM], ids=["SIGHUP", "SIGTERM"])
def test_a_signal_to_the_servers_process_group_drains_the_replicas(signum: int, tiny_llama_dir: Path,
                                                                   tmp_path: Path) -> None:  # fmt: skip
    """A closed terminal (SIGHUP), `kill -TERM -PGID` or a supervisor signals the server's whole process group: a local
    Ray's GCS and raylet lead groups of their own, so the front alone drains the streams on the replicas (in its
    group they died under it: the streams stalled until drain_timeout, or Serve's controller could not be shut down,
    and the front exited 1 for want of its GCS)."""
    server = ClusterServer(tiny_llama_dir, tmp_path / "server.log")
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 200, "ignore_eos": True, "stream": True}

    def stream(client: httpx.Client) -> list:
        with client.stream("POST", "/v1/completions", json=body) as response:
            return parse_sse(response.iter_lines())[0]

    try:
        server.wait_ready()
        with httpx.Client(base_url=server.base_url, timeout=120) as client, ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(stream, client) for _ in range(2)]
            wait_until(lambda: sum(r["in_flight"] for r in server.replicas()) == 2, timeout=30, interval=0.02)
            os.killpg(server.process.pid, signum)
            signalled = time.monotonic()
            results = [f.result(timeout=120) for f in futures]
        assert server.process.wait(120) == 0, server.log_text()[-3000:]
        # Ray's processes killed under the front: Serve's controller could not be shut down (30 s of waiting)
        assert "failed to shut down" not in server.log_text() and time.monotonic() - signalled < 25
        for events in results:
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    finally:
        server.close()


def test_a_model_or_setting_a_replica_refuses_ends_the_server_with_its_reason(tiny_llama_dir: Path,
                                                                           tmp_path: Path) -> None:  # fmt: skip
    """As one process does: exit 1 and one line that says why, within seconds (a replica that exited on a refusal
    was restarted by Ray Serve for minutes behind a front answering 503). The replicas of one machine share its
    memory: each may take half of it for its KV pool."""
    server = ClusterServer(tiny_llama_dir, tmp_path / "server.log", "--num-kv-blocks", "1000000000")
    try:
        assert server.process.wait(START_TIMEOUT) == 1
        line = next(line for line in server.log_text().splitlines() if "the model did not load" in line)
        assert "replica " in line and "of memory available to each of 2 replicas: num_kv_blocks = " in line
    finally:
        server.close()


def test_a_ray_address_where_nothing_listens_ends_the_server_with_its_reason(tiny_llama_dir: Path,
                                                                            tmp_path: Path) -> None:  # fmt: skip
    """Not a process that answers nothing and takes no signal for minutes (ray.init retrying in native code)."""
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    server = ClusterServer(tiny_llama_dir, tmp_path / "server.log", "--ray-address", address)
    try:
        assert server.process.wait(60) == 1
        line = next(line for line in server.log_text().splitlines() if "the model did not load" in line)
        assert f"ray_address '{address}': nothing answers there" in line and "ray start --head" in line
    finally:
        server.close()


@pytest.mark.parametrize(("address", "refusal"), [
    ("auto", ConnectionError("Could not find any running Ray instance.")),  # ray.init's own words
    ("ray://10.0.0.1:10001", ConnectionError("ray client connection timeout")),
    ("bogus", ValueError("Invalid address format: bogus")),
])  # fmt: skip
def test_a_ray_address_ray_cannot_join_is_one_line_naming_the_key(monkeypatch: pytest.MonkeyPatch, address: str,
                                                                  refusal: Exception) -> None:  # fmt: skip
    """"auto" with no Ray running was a traceback of 50 lines (ray.init's ConnectionError): now the load's refusal,
    one line that names ray_address. ray.init is stood in for: "auto" would join any Ray running on this machine."""
    from engine.config import ClusterConfig, SluiceConfig
    from web.cluster import launch

    def init(**kwargs: object) -> None:
        raise refusal

    monkeypatch.setattr(launch.ray, "init", init)
    with pytest.raises(ValueError, match=rf"^ray_address '{address}': {refusal}"):
        launch.launch_replicas(SluiceConfig(cluster=ClusterConfig(replicas=2, ray_address=address)))


@pytest.mark.parametrize(("name", "content", "refusal"), [
    ("no-such-model.gguf", None, "model path does not exist: {path}"),
    ("cut.gguf", b"GGUF\x03\x00\x00\x00", "cannot read {path} as a GGUF file"),
    ("notes.gguf", b"hello", "cannot read {path} as a GGUF file: no GGUF magic bytes"),
])  # fmt: skip
def test_a_local_clusters_model_file_a_replica_would_refuse_is_said_before_ray_starts(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, content: bytes | None, refusal: str) -> None:
    """The replicas of a local Ray run on this machine: a mistyped path or a damaged file was Ray's start (15 s) and
    then each replica's constructor traceback, logged by Serve's controller (150 lines), before the one line that
    says why."""
    from engine.config import ClusterConfig, EngineConfig, SluiceConfig
    from web.cluster import launch

    def init(**kwargs: object) -> None:
        raise AssertionError("Ray was started")

    monkeypatch.setattr(launch.ray, "init", init)
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    config = SluiceConfig(engine=EngineConfig(model=str(path)), cluster=ClusterConfig(replicas=2))
    with pytest.raises(ValueError, match=f"^{refusal.format(path=path)}"):
        launch.launch_replicas(config)


def test_a_local_clusters_chat_template_that_cannot_be_read_is_said_before_ray_starts(
        monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path) -> None:  # fmt: skip
    from engine.config import ClusterConfig, EngineConfig, SluiceConfig
    from web.cluster import launch

    def init(**kwargs: object) -> None:
        raise AssertionError("Ray was started")

    monkeypatch.setattr(launch.ray, "init", init)
    engine = EngineConfig(model=str(tiny_llama_dir), chat_template="no/such/template.jinja")
    with pytest.raises(ValueError, match="^chat_template: no file 'no/such/template.jinja'"):
        launch.launch_replicas(SluiceConfig(engine=engine, cluster=ClusterConfig(replicas=2)))
