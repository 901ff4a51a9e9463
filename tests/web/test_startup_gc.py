"""The start runs without the cyclic collector (the imports and the load make ~300,000 objects that live as long as the
process, and the collector walked them again and again as they grew) and ends with it back on, everything loaded
frozen out of its sight. In a process of its own: the test process's collector is left alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.servers import REPO_ROOT

SCRIPT = """
import gc, json, sys
import anyio
from engine.config import load_config
from web.asgi import build_host
from web.server import hypercorn_config, serve_host

config = load_config(engine_overrides={"model": sys.argv[1], "dtype": "float32", "num_kv_blocks": 64},
                     server_overrides={"host": "127.0.0.1", "port": 0}, environ={})
seen = {"enabled_at_import": gc.isenabled()}
host = build_host(config)
seen["enabled_after_build"] = gc.isenabled()
seen["frozen_after_build"] = gc.get_freeze_count()

async def main():
    stop = anyio.Event()
    async def watch():
        while host.engine.state.value == "loading":
            await anyio.sleep(0.01)
        with anyio.move_on_after(5):  # the host turns it on as the engine's start returns
            while not gc.isenabled():
                await anyio.sleep(0.01)
        seen["state"] = host.engine.state.value
        seen["enabled_when_started"] = gc.isenabled()
        seen["frozen_when_started"] = gc.get_freeze_count()
        stop.set()
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        await serve_host(host, hypercorn_config(config.server), stop)
    seen["enabled_after_stop"] = gc.isenabled()

anyio.run(main)
print(json.dumps(seen))
"""


def run_host(model: str) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, model], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.stdout.strip(), done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_start_runs_without_the_collector_and_ends_with_it_on(tiny_llama_dir: Path) -> None:
    seen = run_host(str(tiny_llama_dir))
    assert seen["enabled_at_import"] is True
    assert seen["enabled_after_build"] is False
    # the imports so far frozen at once: the start's closing collection walks only what the load made
    assert seen["frozen_after_build"] > 10_000
    assert seen["state"] == "ready"
    assert seen["enabled_when_started"] is True
    # transformers and the model joined them
    assert seen["frozen_when_started"] > seen["frozen_after_build"] + 1_000
    assert seen["enabled_after_stop"] is True


def test_a_load_that_fails_turns_the_collector_back_on(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + bytes(60))  # a truncated file: the loader refuses it
    seen = run_host(str(tmp_path / "model.gguf"))
    assert seen["enabled_after_build"] is False
    assert seen["state"] == "dead"
    assert seen["enabled_when_started"] is True
    assert seen["enabled_after_stop"] is True
