"""`python -m bench` end to end against a real Sluice server on the tiny local model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.servers import REPO_ROOT

from tests.support.sluice_process import running_sluice


@pytest.fixture(scope="module")
def sluice_url(tiny_llama_dir: Path, tmp_path_factory):
    # A small admission queue, so that the burst below may see 429s (they must be counted, not lost).
    log = tmp_path_factory.mktemp("sluice") / "server.log"
    with running_sluice(tiny_llama_dir, log, "--max-pending", "4") as (url, _):
        yield url


def run_bench(args: list[str], out: Path) -> dict:
    command = [sys.executable, "-m", "bench", "--no-progress", "--json", str(out), *args]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TTFT ms" in done.stdout
    return json.loads(out.read_text())


def check_accounting(level: dict, sent: int, max_tokens: int) -> None:
    assert level["sent"] == sent
    assert level["completed"] + level["rejected_429"] + level["errors"] == sent
    assert level["errors"] == 0, level["error_samples"]
    assert level["usage_reported"]
    assert level["completion_tokens"] == max_tokens * level["completed"]  # ignore_eos: exactly max_tokens each
    ok = [r for r in level["requests"] if r["status"] == 200]
    assert len(ok) == level["completed"]
    assert level["prompt_tokens"] == sum(r["prompt_tokens"] for r in ok) > 0
    assert all(r["finish_reason"] == "length" and r["ttft"] is not None for r in ok)
    assert level["ttft_s"]["n"] == level["completed"]


def test_closed_loop_sweep_on_both_endpoints(sluice_url: str, tmp_path: Path) -> None:
    for endpoint in ("chat", "completions"):
        data = run_bench(["--url", sluice_url, "--endpoint", endpoint, "--sweep", "1,3", "--num-requests", "6",
                          "--prompt-tokens", "uniform:4:24", "--output-tokens", "8", "--warmup", "1"],
                         tmp_path / f"{endpoint}.json")
        assert [(lv["mode"], lv["level"]) for lv in data["levels"]] == [("closed", 1), ("closed", 3)]
        for level in data["levels"]:
            check_accounting(level, 6, 8)
            assert level["rejected_429"] == 0  # at most 3 in flight, 4 may wait
            assert level["itl_s"]["n"] > 0
        assert data["config"]["targets"][0]["model"]  # discovered from /v1/models


def test_burst_counts_every_request(sluice_url: str, tmp_path: Path) -> None:
    data = run_bench(["--url", sluice_url, "--burst", "24", "--output-tokens", "6", "--prompt-tokens", "16",
                      "--warmup", "0"], tmp_path / "burst.json")
    (level,) = data["levels"]
    check_accounting(level, 24, 6)
    assert level["admission_s"]["n"] == 24
    assert all(r["status"] in (200, 429) for r in level["requests"])


def test_lean_closed_loop_times_every_request(sluice_url: str) -> None:
    command = [sys.executable, "-m", "bench", "burst", "--url", sluice_url, "--streams", "3", "--size", "7",
               "--prompt-tokens", "8", "--output-tokens", "4"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("3 streaming chats at a time, 7 in all: 7 requests") and "HTTP/1.1 200" in lines[0]
    assert lines[1].startswith("  their first wave (3 at once): 3 requests")
    assert lines[2].startswith("  after it: 4 requests")


def metric(url: str, name: str) -> float:
    import httpx

    line = next(line for line in httpx.get(f"{url}/metrics").text.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])


def test_each_level_sends_prompts_of_its_own(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A level that sent the last level's prompts again met them in the prefix cache (TTFT 1,010 -> 70 ms between
    two equal levels): each level's prompts come from the run's seed plus its index."""
    with running_sluice(tiny_llama_dir, tmp_path / "server.log") as (url, _):
        data = run_bench(["--url", url, "--endpoint", "completions", "--sweep", "1,1", "--num-requests", "3",
                          "--prompt-tokens", "64", "--output-tokens", "2", "--warmup", "0", "--seed", "5"],
                         tmp_path / "levels.json")  # fmt: skip
        assert [lv["completed"] for lv in data["levels"]] == [3, 3] and data["config"]["seed"] == 5
        assert metric(url, "sluice_prefix_cache_hit_rate") < 0.05


def test_an_api_key_is_sent_and_a_run_that_measured_nothing_fails(tiny_llama_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_API_KEY", "sk-bench")
    with running_sluice(tiny_llama_dir, tmp_path / "server.log") as (url, _):
        args = ["--url", url, "--num-requests", "2", "--prompt-tokens", "8", "--output-tokens", "2", "--warmup", "0"]
        monkeypatch.setenv("OPENAI_API_KEY", "sk-bench")
        (level,) = run_bench(args, tmp_path / "key.json")["levels"]
        assert level["completed"] == 2
        monkeypatch.setenv("OPENAI_API_KEY", "sk-wrong")
        command = [sys.executable, "-m", "bench", "--no-progress", *args]
        done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 1 and "every request failed" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("flags", [["--sweep", "1,,4"], ["--sweep", "0,2"], ["--num-requests", "abc"],
                                   ["--num-requests", "0"], ["--num-requests", "-3"], ["--concurrency", "0"],
                                   ["--rate", "-1"], ["--burst", "0"], ["--sweep", "1.5"], ["--timeout", "0"],
                                   ["--max-duration", "-1"]])  # fmt: skip
def test_bad_flags_are_usage_errors(flags: list[str], capsys: pytest.CaptureFixture) -> None:
    from bench.cli import parse_args

    with pytest.raises(SystemExit) as caught:
        parse_args(flags)
    assert caught.value.code == 2 and flags[0] in capsys.readouterr().err
