"""The `sluice` command: one flag per config key resolved like the server's, serve, generate, bench."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import httpx
import pytest

from engine.config import EngineConfig, ServerConfig
from engine.sampling_params import SamplingParams
from web.cli import generate_parser
from web.config_flags import config_from_args, documented_keys
from web.server import parse_args

from tests.support.server_harness import REPO, free_port, wait_until

PROMPT = "The quick brown fox"


def sluice(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "web.cli", *args],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_console_script_and_make_serve_run_web_cli() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["sluice"] == "web.cli:main"
    makefile = (REPO / "Makefile").read_text()
    assert "bin/sluice serve $(ARGS)" in makefile.split("serve: install", 1)[1].split("\n\n", 1)[0]


@pytest.mark.parametrize("command,classes", [("serve", (EngineConfig, ServerConfig)), ("generate", (EngineConfig,))])
def test_help_lists_every_knob_with_its_documentation_and_default(command: str, classes: tuple[type, ...]) -> None:
    done = sluice(command, "--help", env={"SLUICE_API_KEY": "sk-secret-in-env", "SLUICE_MAX_NUM_SEQS": "7"})
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # argparse wraps lines
    docs = documented_keys()
    for cls in classes:
        section = "engine" if cls is EngineConfig else "server"
        for f in fields(cls):
            flag = f"--{f.name.replace('_', '-')}"
            assert flag in text, flag
            assert docs[(section, f.name)], f"{section}.{f.name} has no comment in config.toml"
    assert "(default: 7; from SLUICE_MAX_NUM_SEQS)" in text  # the value that applies, and where it comes from
    assert "(default: 'bfloat16')" in text and "(default: 16)" in text
    assert "sk-secret-in-env" not in done.stdout
    if command == "serve":
        assert "--api-key TEXT" in text and "(default: set; from SLUICE_API_KEY)" in text
        assert "(default: 256)" in text  # max_pending


def test_flags_win_over_environment_which_wins_over_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_file = tmp_path / "sluice.toml"
    config_file.write_text(
        '[engine]\nmax_num_seqs = 3\ndtype = "float32"\nblock_size = 32\n'
        '[server]\nport = 7001\nmax_pending = 5\napi_key = "from-file"\n'
    )
    monkeypatch.setenv("SLUICE_MAX_NUM_SEQS", "9")
    monkeypatch.setenv("SLUICE_PORT", "7002")
    monkeypatch.setenv("SLUICE_API_KEY", "from-env")
    config = config_from_args(parse_args(["--config", str(config_file), "--port", "7003", "--dtype", "bfloat16"]))
    assert (config.engine.dtype, config.server.port) == ("bfloat16", 7003)  # flags
    assert (config.engine.max_num_seqs, config.server.api_keys) == (9, ("from-env",))  # environment
    assert (config.engine.block_size, config.server.max_pending) == (32, 5)  # file
    assert config.server.drain_timeout == ServerConfig().drain_timeout  # built-in default

    generate = config_from_args(generate_parser().parse_args(["hi", "--config", str(config_file), "--max-num-seqs", "2"]))
    assert (generate.engine.max_num_seqs, generate.engine.block_size) == (2, 32)

    monkeypatch.setenv("SLUICE_MAX_PENDING", "many")
    with pytest.raises(ValueError, match="max_pending expects an integer"):
        config_from_args(parse_args([]))


def test_help_shows_the_values_of_the_file_config_names(tmp_path: Path) -> None:
    config_file = tmp_path / "other.toml"
    config_file.write_text("[server]\nport = 8234\n[engine]\nmax_num_seqs = 5\n")
    text = " ".join(sluice("serve", "--config", str(config_file), "--help").stdout.split())
    assert "listen on. (default: 8234)" in text and "(default: 5)" in text
    text = " ".join(sluice("generate", "--config", str(config_file), "--help").stdout.split())
    assert "(default: 5)" in text
    config_file.write_text("[server]\nport = 8234\nbogus = 1\n")
    text = " ".join(sluice("serve", "--config", str(config_file), "--help").stdout.split())
    assert "other.toml: unknown [server] keys: ['bogus']" in text and "could not be read" in text
    assert "the defaults shown are built in" in text


def test_bad_values_exit_2_with_the_reason() -> None:
    done = sluice("serve", "--max-pending", "0")
    assert done.returncode == 2 and "max_pending must be >= 1" in done.stderr
    done = sluice("generate", "hi", "--top-p", "0")
    assert done.returncode == 2 and "top_p must be in (0, 1]" in done.stderr
    for empty in (["", "--raw"], [""], ["-"]):  # chat sent an empty user message
        done = subprocess.run([sys.executable, "-m", "web.cli", "generate", *empty], cwd=REPO, input="",
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 2 and "the prompt is empty" in done.stderr and "Traceback" not in done.stderr
    done = sluice("frobnicate")
    assert done.returncode == 2 and "unknown command" in done.stderr
    done = sluice("serve", "--config", "no-such-file.toml")  # not the defaults, silently
    assert done.returncode == 2 and "config file 'no-such-file.toml' not found" in done.stderr
    for flags, reason in ((["--log-level", "verbose"], "log_level must be one of"),
                          (["--retry-after-seconds", "-3"], "retry_after_seconds must be >= 0"),
                          (["--drain-timeout", "nan"], "drain_timeout must be a finite number"),
                          (["--body-timeout", "inf"], "body_timeout must be a finite number"),
                          (["--backlog", "1000000000000000000000"], "backlog must be in [1, 65535]"),
                          (["--graceful-timeout", "-1"], "graceful_timeout must be >= 0, got -1"),
                          (["--client-read-timeout", "0"], "client_read_timeout must be > 0, got 0"),
                          (["--responses-store-ttl", "0"], "responses_store_ttl must be > 0, got 0"),
                          (["--num-threads", "10000"], "num_threads must be in [0, 1024]"),
                          (["--host", ""], "host must not be empty"),
                          (["--cache-dir", ""], "cache_dir must not be empty")):  # it was the working directory
        done = sluice("serve", *flags)
        assert done.returncode == 2 and reason in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[server]\napi_key = 12345\n", "api_key expects a string, got 12345"),
        ("[engine]\nnum_threads = 1.5\n", "bad.toml [engine]: num_threads expects an integer, got 1.5"),  # which file
        ("[server]\nport = true\n", "bad.toml [server]: port expects an integer, got True"),
        ("[server]\nmax_pending = [1, 2]\n", "max_pending expects an integer"),
        ('[server]\nport = "18621"\n', "port expects an integer, got '18621'"),  # TOML has types: no parsing
        ('[server]\nmetrics_need_key = "no"\n', "metrics_need_key expects a boolean, got 'no'"),
        ("[server]\ndrain_timeout = nan\n", "drain_timeout must be a finite number of seconds, got nan"),
        ("[sever]\nport = 9000\n", "unknown sections or keys ['sever']"),
        ("port = 9000\n", "unknown sections or keys ['port']"),
        ("[server]\nprot = 9000\n", "bad.toml: unknown [server] keys: ['prot']"),  # the file that says it is named
        ("[server\nport = 9000\n", "bad.toml: not valid TOML: Expected ']'"),
        ("[server]\nport = 1\nport = 2\n", "bad.toml: not valid TOML: Cannot overwrite a value"),
    ],
)
def test_a_config_file_of_wrong_types_or_sections_is_one_line_and_exit_2(tmp_path: Path, text: str, reason: str) -> None:
    config_file = tmp_path / "bad.toml"
    config_file.write_text(text)
    for done in (sluice("serve", "--config", str(config_file)), sluice("serve", env={"SLUICE_CONFIG": str(config_file)})):
        assert done.returncode == 2 and reason in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_misspelt_environment_variable_is_named_in_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    from engine.config import load_config

    environ = {"SLUICE_API_KEYS": "sk-one", "SLUICE_PORT": "9001", "SLUICE_ISA": "avx2", "SLUICE_NATIVE": "1"}
    with caplog.at_level("WARNING", logger="sluice.config"):
        config = load_config(environ=environ)
    assert config.server.api_key == "" and config.server.port == 9001  # the misspelt key is not read
    (record,) = caplog.records
    assert "unknown environment variables ignored: SLUICE_API_KEYS" in record.getMessage()


def test_a_kv_pool_larger_than_the_memory_left_is_refused_at_start() -> None:
    """Blocks take memory as they fill: such a pool would serve for hours, then meet the OOM killer."""
    done = sluice("serve", "--port", "0", "--num-kv-blocks", "100000000")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "the KV pool of num_kv_blocks = 100000000 of block_size = 16 tokens needs" in done.stderr
    assert "GiB of memory available: num_kv_blocks = " in done.stderr


def test_a_port_it_cannot_listen_on_is_one_line_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = sluice("serve", "--port", str(port), timeout=60)
    assert done.returncode == 1 and f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "Traceback" not in done.stderr and "engine" not in done.stderr  # no model was loaded
    done = sluice("serve", "--host", "no-such-host.invalid", timeout=60)
    assert done.returncode == 1 and "cannot listen on no-such-host.invalid" in done.stderr and "Traceback" not in done.stderr


def test_generate_names_a_model_it_cannot_load(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file" * 8)
    for model, reason in ((junk, "as a GGUF file"), (tmp_path / "missing.gguf", "does not exist")):
        done = sluice("generate", "hi", "--model", str(model), timeout=120)
        assert done.returncode == 1 and "the model did not load" in done.stderr and reason in done.stderr
        assert "Traceback" not in done.stderr


# ---- generate ---------------------------------------------------------------------------------------------
def test_generate_streams_the_same_text_as_the_offline_api(tiny_llama_dir: Path) -> None:
    from engine import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = llm.generate(PROMPT, params, use_tqdm=False)[0].text
    engine_flags = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--num-kv-blocks", "64"]
    done = sluice("generate", PROMPT, "--raw", "--temperature", "0", "--max-tokens", "12", "--ignore-eos", "--stats",
                  *engine_flags)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"
    assert "12 tokens" in done.stderr and "finish: length" in done.stderr and "TTFT" in done.stderr

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    expected_chat = llm.chat(messages, params, use_tqdm=False)[0].text
    done = sluice("generate", PROMPT, "--system", "Be brief.", "--temperature", "0", "--max-tokens", "12",
                  "--ignore-eos", *engine_flags)  # fmt: skip
    assert done.returncode == 0 and done.stdout == expected_chat + "\n"


def test_llm_stream_yields_each_token_as_made_and_aborts_when_closed(tiny_llama_dir: Path) -> None:
    from engine import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    deltas = list(llm.stream(PROMPT, params))
    assert [len(d.new_token_ids) for d in deltas] == [1] * 10 and deltas[-1].finished
    assert "".join(d.text_delta for d in deltas) == llm.generate(PROMPT, params, use_tqdm=False)[0].text

    free_before = llm.engine.num_free_blocks
    stream = llm.stream(PROMPT, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    next(stream)
    assert llm.engine.has_unfinished_requests
    stream.close()
    assert not llm.engine.has_unfinished_requests and llm.engine.num_free_blocks == free_before
    with pytest.raises(ValueError):
        next(llm.stream("", params))


# ---- serve and bench --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config_file = tmp_path_factory.mktemp("cli") / "sluice.toml"
    config_file.write_text(f'[engine]\nmodel = "{tiny_llama_dir}"\ndtype = "float32"\n'
                           '[server]\nserved_model_name = "from-file"\n')  # fmt: skip
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SLUICE_SERVED_MODEL_NAME": "from-env", "SLUICE_CORS_ORIGINS": "*",
           "SLUICE_PORT": "1"}  # fmt: skip
    command = [sys.executable, "-m", "web.cli", "serve", "--config", str(config_file), "--port", str(port)]
    log = config_file.parent / "server.log"  # a file: the access log's lines would fill a pipe no one reads
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, timeout=180, interval=0.25)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


def test_serve_logs_a_line_per_request(served: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The access log is on by default, as under `hypercorn -c web/hypercorn.toml` (and vLLM's uvicorn)."""
    assert httpx.post(f"{served}/v1/completions", json={"model": "x", "prompt": "hi"}).status_code == 404
    log = next(tmp_path_factory.getbasetemp().glob("cli*/server.log"))
    wait_until(lambda: '"POST /v1/completions 1.1" 404' in log.read_text(), timeout=10)
    assert "sluice.access" in log.read_text()


def test_serve_takes_the_file_then_the_environment_then_flags(served: str) -> None:
    models = httpx.get(f"{served}/v1/models", headers={"Origin": "https://page.example"})
    assert models.json()["data"][0]["id"] == "from-env"
    assert models.headers["access-control-allow-origin"] == "*"
    assert "<title>Sluice</title>" in httpx.get(served).text


def test_bench_is_the_load_generator(served: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = sluice("bench", "--url", served, "--concurrency", "2", "--num-requests", "4", "--prompt-tokens", "8",
                  "--output-tokens", "4", "--warmup", "0", "--no-progress", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (level,) = json.loads(out.read_text())["levels"]
    assert level["completed"] == 4 and level["completion_tokens"] == 16


def test_bench_help_names_the_command_it_was_called_by() -> None:
    """`sluice bench ... --help` shows `sluice bench ...` usage lines, `python -m bench` its own."""
    for args, usage in ((("bench", "--help"), "usage: sluice bench <mode>"),
                        (("bench", "kernels", "--help"), "usage: sluice bench kernels "),
                        (("bench", "load", "--help"), "usage: sluice bench load [-h]"),
                        (("bench", "--url", "http://127.0.0.1:1", "--help"), "usage: sluice bench [-h]")):  # fmt: skip
        done = sluice(*args)
        assert done.returncode == 0 and done.stdout.startswith(usage), (args, done.stdout[:200], done.stderr[-500:])
    own = subprocess.run([sys.executable, "-m", "bench", "step", "--help"], cwd=REPO, capture_output=True, text=True)
    assert own.returncode == 0 and own.stdout.startswith("usage: python -m bench step ")
    unknown = sluice("bench", "nope")
    assert unknown.returncode == 2 and unknown.stderr.startswith("sluice bench: unknown mode 'nope'")
