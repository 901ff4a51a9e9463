"""The pieces of the soak and abuse modes and of the llama-server peer, without a server."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest

from bench import growth, hostile, llama_peer, soak
from bench.bad_input import MIB, NUM_TOKEN_IDS, catalogue
from bench.health_probe import HealthSample, is_idle
from bench.proc import ProcessSample, is_alive, listening_pid, parse_status, read_process
from bench.runner import LoadShape

STATUS = """Name:\tpython
State:\tS (sleeping)
VmPeak:\t  900000 kB
VmRSS:\t  123456 kB
RssAnon:\t   100000 kB
Threads:\t7
"""


def test_status_parsing() -> None:
    assert parse_status(STATUS) == (123456 * 1024, 7)
    with pytest.raises(ValueError):
        parse_status("Name:\tzombie\nState:\tZ (zombie)\nThreads:\t1\n")  # a zombie has no VmRSS


def test_read_process_from_a_proc_tree(tmp_path: Path) -> None:
    (tmp_path / "42" / "fd").mkdir(parents=True)
    (tmp_path / "42" / "status").write_text(STATUS)
    for fd in range(5):
        (tmp_path / "42" / "fd" / str(fd)).touch()
    sample = read_process(42, tmp_path)
    assert (sample.rss_bytes, sample.num_fds, sample.num_threads) == (123456 * 1024, 5, 7)
    assert not is_alive(43, tmp_path)


def test_read_process_sees_this_process_open_a_file_and_start_a_thread(tmp_path: Path) -> None:
    before = read_process(os.getpid())
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    with open(tmp_path / "f", "w"):
        thread.start()
        during = read_process(os.getpid())
        release.set()
        thread.join()
    assert before.rss_bytes > 0
    assert during.num_fds == before.num_fds + 1
    assert during.num_threads == before.num_threads + 1


def sample(rss_mib: float, fds: int, threads: int) -> ProcessSample:
    return ProcessSample(0.0, int(rss_mib * growth.MIB), fds, threads)


def test_growth_verdict() -> None:
    start = sample(1000, 20, 10)
    assert not growth.has_grown(growth.judge(start, sample(1000 + 29, 22, 12)))  # within the allowances
    rss, fds, threads = growth.judge(start, sample(1000 + 31, 20, 10))
    assert not rss.is_growth  # 3% of 1000 MiB is 30 MiB, below the 32 MiB floor
    assert growth.judge(start, sample(1033, 20, 10))[0].is_growth
    big = growth.judge(sample(4000, 20, 10), sample(4100, 20, 10))[0]
    assert big.allowance == round(0.03 * 4000 * growth.MIB) and not big.is_growth  # 120 MiB of 4000 is noise
    verdicts = growth.judge(start, sample(900, 23, 13))
    assert [v.is_growth for v in verdicts] == [False, True, True]  # shrinking is fine, +3 fds / threads is not
    assert "GROWTH" in verdicts[1].describe() and "ok" in verdicts[0].describe()
    assert growth.has_grown(verdicts)


def test_soak_verdict_counts_kv_blocks_and_queues_at_rest() -> None:
    config = soak.SoakConfig()
    rest = {"state": "ready", "waiting": 0, "running": 0, "pending": 0, "free_kv_blocks": 64, "total_kv_blocks": 64}
    result = soak.SoakResult("http://127.0.0.1:1", 1, config, start=sample(500, 10, 5), end=sample(501, 10, 5),
                             end_health=HealthSample(0.0, 0.001, 200, rest))
    assert result.is_clean and result.kv_blocks_leaked == 0
    result.end_health = HealthSample(0.0, 0.001, 200, {**rest, "free_kv_blocks": 60})
    assert result.kv_blocks_leaked == 4 and not result.is_clean
    result.end_health = HealthSample(0.0, 0.001, 200, {**rest, "pending": 1})
    assert not is_idle(result.end_health) and not result.is_clean
    result.end_health, result.end = HealthSample(0.0, 0.001, 200, rest), sample(600, 10, 5)
    assert not result.is_clean  # +100 MiB
    result.outcomes = [hostile.Outcome("stream", "ok", 200), hostile.Outcome("stream", "reset"),
                       hostile.Outcome("garbage-json", "rejected", 400)]
    summary = result.summary()
    assert summary["outcomes"] == {"garbage-json": {"rejected": 1}, "stream": {"ok": 1, "reset": 1}}
    assert summary["sent"] == 3 and "verdict: NOT clean" in soak.report(result)


def test_bad_input_catalogue() -> None:
    bad = {b.name: b for b in catalogue("m")}
    assert len(bad["oversized-body"].body) > 4 * MIB  # over Sluice's default limit
    assert MIB < len(bad["megabytes-of-text"].body) < 4 * MIB  # under it: reaches the prompt checks
    assert len(json.loads(bad["million-token-ids"].body)["prompt"]) == NUM_TOKEN_IDS
    assert len(json.loads(bad["huge-stop-list"].body)["stop"]) > 1000
    for b in bad.values():
        assert b.expected and all(400 <= s < 500 or s == 200 for s in b.expected), b.name
        if b.content_type == "application/json" and b.name not in ("garbage-json", "empty-body"):
            json.loads(b.body)
    with pytest.raises(ValueError):
        json.loads(bad["garbage-json"].body)
    assert json.loads(bad["unknown-model"].body)["model"] != "m"
    assert all(json.loads(b.body)["model"] == "m" for name, b in bad.items() if name.startswith("extreme-sampling"))


def test_outcome_of_a_status() -> None:
    rejected = frozenset({400, 413})
    assert hostile._status_outcome(400, rejected) == "rejected"
    assert hostile._status_outcome(404, rejected) == "unexpected"
    assert hostile._status_outcome(429, rejected) == "busy"
    assert hostile._status_outcome(500, rejected) == "failed"
    assert hostile._status_outcome(200, rejected | {200}) == "accepted"


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:9", "http://[::1]:80", "http://127.3.2.1"])
def test_loopback_urls_are_accepted(url: str) -> None:
    host, port = hostile.require_loopback(url)
    assert host and port > 0


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "https://8.8.8.8", "not a url"])
def test_other_urls_are_refused(url: str) -> None:
    with pytest.raises(SystemExit):
        hostile.require_loopback(url)


def test_llama_server_command_for_a_concurrency() -> None:
    command = llama_peer.llama_command("/bin/llama-server", "/m.gguf", 8123, 8)
    options = dict(zip(command[1::2], command[2::2]))
    assert command[0] == "/bin/llama-server" and command[-1] == "--no-webui"
    assert options["--model"] == "/m.gguf" and options["--host"] == "127.0.0.1" and options["--port"] == "8123"
    assert options["--parallel"] == "8" and options["--threads"] == options["--threads-batch"] == "2"
    assert options["--ctx-size"] == str(8 * llama_peer.CTX_PER_SLOT)
    assert llama_peer.parallel_for(LoadShape("closed", 32)) == 32
    assert llama_peer.parallel_for(LoadShape("burst", 256)) == 256
    assert llama_peer.parallel_for(LoadShape("rate", 2.5), rate_parallel=12) == 12


def test_llama_peer_is_skipped_with_a_note_without_a_binary(capsys, tmp_path: Path) -> None:
    assert llama_peer.check_binary(None) is None
    assert "llama: skipped" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        llama_peer.check_binary(str(tmp_path / "missing"))
    plain = tmp_path / "not-executable"
    plain.write_text("")
    with pytest.raises(SystemExit):
        llama_peer.check_binary(str(plain))
    plain.chmod(0o755)
    assert llama_peer.check_binary(str(plain)) == str(plain.resolve())


def test_llama_peer_uses_the_gguf_sluice_serves() -> None:
    assert llama_peer.resolve_gguf("/x.gguf", "") == "/x.gguf"
    assert llama_peer.resolve_gguf(None, "~/m.Q4_1.gguf") == os.path.expanduser("~/m.Q4_1.gguf")
    default = Path(llama_peer.resolve_gguf(None, ""))
    assert default.is_file() and default.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(SystemExit):
        llama_peer.resolve_gguf(None, "/some/hf-folder")


def test_the_process_listening_on_a_port_is_found() -> None:
    with socket.socket() as listener, socket.socket() as bound_only:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        bound_only.bind(("127.0.0.1", 0))
        assert listening_pid(listener.getsockname()[1]) == os.getpid()
        assert listening_pid(bound_only.getsockname()[1]) is None  # bound, not listening
