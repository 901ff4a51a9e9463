"""Soak, abuse and the llama-server peer end to end: a real Sluice server on the tiny model, and a stand-in
llama-server (a small Python script that records its command line). Loose checks: every request is
accounted for and the figures are there; no timing thresholds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.abuse import ABUSE_KINDS
from bench.servers import REPO_ROOT

from tests.support.sluice_process import running_sluice

TINY_SERVER_ARGS = ("--num-kv-blocks", "64", "--max-num-seqs", "8", "--num-threads", "1")
# The tiny model's tokenizer makes about four tokens of a word, and its context is 512 tokens.
TINY_WORKLOAD = ["--prompt-tokens", "uniform:2:24", "--output-tokens", "uniform:1:12", "--long-output-tokens", "200",
                 "--warmup-prompt-tokens", "24", "--warmup-output-tokens", "16", "--warmup-concurrency", "4"]


def run_bench(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "bench", "--no-progress", *args]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def sluice(tiny_llama_dir: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("sluice") / "server.log"
    with running_sluice(tiny_llama_dir, log, *TINY_SERVER_ARGS) as (url, process):
        yield url, process.pid


def test_soak_accounts_for_every_request_and_reports_the_process(sluice, tmp_path: Path) -> None:
    url, pid = sluice
    out = tmp_path / "soak.json"
    done = run_bench(["--soak", "--url", url, "--server-pid", str(pid), "--duration", "8", "--concurrency", "6",
                      "--never-read-seconds", "2", "--settle-seconds", "15", "--checkpoints", "2", "--json", str(out),
                      *TINY_WORKLOAD])
    assert done.returncode in (0, 1), done.stderr[-3000:]  # 1: the server did not hold up (its verdict, not ours)
    data = json.loads(out.read_text())
    assert data["pid"] == pid and data["sent"] == len(data["requests"]) > 0
    assert sum(n for by in data["outcomes"].values() for n in by.values()) == data["sent"]
    assert {"stream", "non-stream", "disconnect"} <= set(data["outcomes"])
    assert any(r["kind"] not in ("stream", "non-stream", "disconnect", "never-read") for r in data["requests"])
    warm = data["warmup"]
    assert warm["errors"] == 0 and warm["total_kv_blocks"] == 64
    assert warm["tokens"] >= warm["pool_tokens"] == 64 * 16  # as many tokens as the KV pool holds went by
    for figure in ("start", "end"):
        assert all(data[figure][key] > 0 for key in ("rss_bytes", "num_fds", "num_threads"))
    assert [v["name"] for v in data["verdicts"]] == ["rss_bytes", "num_fds", "num_threads"]
    assert len(data["process_samples"]) >= 4 and data["health_s"]["n"] > 0
    assert len(data["checkpoints"]) == 2 and all(c["rss_bytes"] > 0 for c in data["checkpoints"])
    assert set(data["priming"]) >= {"stream", "never-read", "oversized-body", "huge-stop-list"}
    assert data["end_health"]["total_kv_blocks"] == 64
    assert "verdict:" in done.stdout and "rss" in done.stdout


def test_abuse_reports_health_alone_and_under_bad_input(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """bench starts the server itself here (no --url)."""
    out = tmp_path / "abuse.json"
    sluice_args = [f"--sluice-arg={a}" for a in ("--dtype=float32", *TINY_SERVER_ARGS)]
    done = run_bench(["--abuse", "--duration", "4", "--abusers", "2", "--sluice-model", str(tiny_llama_dir),
                      *sluice_args, "--log-dir", str(tmp_path / "logs"), "--json", str(out)])
    assert done.returncode in (0, 1), done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["baseline_health_s"]["n"] > 0 and data["health_s"]["n"] > 0
    assert all(data[key]["p99"] is not None for key in ("baseline_health_s", "health_s"))
    assert data["sent"] == len(data["requests"]) >= 2
    assert set(data["outcomes"]) <= set(ABUSE_KINDS)
    assert sum(n for by in data["outcomes"].values() for n in by.values()) == data["sent"]
    assert "/health" in done.stdout and "under abuse" in done.stdout


FAKE_LLAMA_SERVER = '''#!{python}
"""Stands in for llama-server: records its arguments, streams `max_tokens` one-word events."""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
with open({record!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
port = int(args[args.index("--port") + 1])


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self.reply(200, {{"status": "ok"}})
        elif self.path == "/v1/models":
            self.reply(200, {{"object": "list", "data": [{{"id": "fake.gguf"}}]}})
        else:
            self.reply(501, {{"error": {{"message": "no"}}}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for i in range(body["max_tokens"]):
            self.wfile.write(b'data: {{"choices": [{{"index": 0, "text": "w ", "finish_reason": null}}]}}\\n\\n')
        usage = {{"prompt_tokens": 3, "completion_tokens": body["max_tokens"]}}
        end = {{"choices": [{{"index": 0, "text": "", "finish_reason": "length"}}], "usage": usage}}
        self.wfile.write(b"data: " + json.dumps(end).encode() + b"\\n\\ndata: [DONE]\\n\\n")
        self.close_connection = True


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def test_llama_server_peer_is_started_per_level_with_that_many_slots(tiny_llama_dir: Path, tmp_path: Path) -> None:
    record = tmp_path / "argv.jsonl"
    fake = tmp_path / "llama-server"
    fake.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable, record=str(record)))
    fake.chmod(0o755)
    out = tmp_path / "compare.json"
    done = run_bench(["--compare", "--servers", "llama", "--llama-server", str(fake), "--llama-model", "/m.gguf",
                      "--hf-model-dir", str(tiny_llama_dir), "--sweep", "1,3", "--num-requests", "3",
                      "--endpoint", "completions", "--prompt-tokens", "4", "--output-tokens", "5", "--warmup", "1",
                      "--log-dir", str(tmp_path / "logs"), "--json", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    starts = [json.loads(line) for line in record.read_text().splitlines()]
    assert [s[s.index("--parallel") + 1] for s in starts] == ["1", "3"]  # restarted for the second level
    assert all(s[s.index("--threads") + 1] == "2" and s[s.index("--model") + 1] == "/m.gguf" for s in starts)
    levels = json.loads(out.read_text())["levels"]
    assert [(lv["target"], lv["level"]) for lv in levels] == [("llama", 1), ("llama", 3)]
    assert all(lv["completed"] == 3 and lv["completion_tokens"] == 15 and lv["errors"] == 0 for lv in levels)


def test_compare_without_a_llama_binary_skips_the_peer_with_a_note(tiny_llama_dir: Path, tmp_path: Path) -> None:
    done = run_bench(["--compare", "--servers", "llama", "--hf-model-dir", str(tiny_llama_dir), "--num-requests", "1"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "llama: skipped (no --llama-server PATH given" in done.stderr
    assert "llama" not in done.stdout.split("\n", 2)[-1]  # no row for it
