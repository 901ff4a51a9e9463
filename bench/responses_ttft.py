"""Time to first text: /v1/responses' first response.output_text.delta against /v1/chat/completions' first
content delta, the same prompts, one request at a time.

    python -m bench.responses_ttft [--url URL] [--pairs 40] [--prompt-tokens 128] [--output-tokens 8]

Without --url it starts Sluice (`python -m web.server`, its configured model) on a free loopback port and
stops it after. Every request has a prompt of its own (no prefix-cache hit between the two kinds beyond the
chat template's shared head, which both get alike); the two kinds alternate, chat first in even pairs and
responses first in odd ones, so a drift of the machine's load hits both. Reports each kind's median, mean
and p90, and the ratio responses / chat of the medians (the target: within 5%).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import orjson

from bench.client import Target, discover_model
from bench.servers import free_port, sluice_command, start_ready
from bench.sse import SSEParser
from bench.workload import LengthDist, build_workload

LOG_DIR = Path(__file__).resolve().parent / "results" / "logs"


async def time_to_first_text(client: httpx.AsyncClient, url: str, body: dict, is_text: callable) -> float | None:
    """Seconds from the send to the first event that carries text (None: the answer had no text)."""
    start = time.perf_counter()
    parser = SSEParser()
    first = None
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for chunk in response.aiter_bytes():
            for event in parser.feed(chunk):
                if first is None and event.data != "[DONE]" and is_text(orjson.loads(event.data)):
                    first = time.perf_counter() - start
    return first


def chat_has_text(chunk: dict) -> bool:
    return any(choice["delta"].get("content") for choice in chunk.get("choices", []))


def responses_has_text(event: dict) -> bool:
    return event["type"] == "response.output_text.delta" and bool(event["delta"])


async def measure(url: str, pairs: int, prompt_tokens: int, output_tokens: int) -> dict[str, list[float]]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        model = await discover_model(client, Target("sluice", url))
        specs = build_workload(2 * pairs + 2, LengthDist("fixed", prompt_tokens), LengthDist("fixed", output_tokens),
                               seed=0)  # fmt: skip
        chat = lambda p: dict(model=model, messages=[{"role": "user", "content": p}], max_tokens=output_tokens,  # noqa: E731
                              temperature=0, stream=True)  # fmt: skip
        responses = lambda p: dict(model=model, input=p, max_output_tokens=output_tokens, temperature=0,  # noqa: E731
                                   stream=True, store=False)  # fmt: skip
        kinds = {"chat": (f"{url}/v1/chat/completions", chat, chat_has_text),
                 "responses": (f"{url}/v1/responses", responses, responses_has_text)}  # fmt: skip
        # Warm-up: one of each (template, tokenizer, first forward pass).
        for name, (path, body, is_text) in kinds.items():
            await time_to_first_text(client, path, body(specs[-1 if name == "chat" else -2].prompt), is_text)
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for i in range(pairs):
            order = ["chat", "responses"] if i % 2 == 0 else ["responses", "chat"]
            for j, name in enumerate(order):
                path, body, is_text = kinds[name]
                seconds = await time_to_first_text(client, path, body(specs[2 * i + j].prompt), is_text)
                if seconds is not None:
                    times[name].append(seconds)
    return times


def report(times: dict[str, list[float]]) -> None:
    print("| endpoint | requests with text | median TTFT ms | mean ms | p90 ms |")
    print("| --- | --- | --- | --- | --- |")
    for name, values in times.items():
        p90 = statistics.quantiles(values, n=10)[-1] if len(values) >= 2 else values[0]
        print(f"| {name} | {len(values)} | {statistics.median(values) * 1e3:.1f} | "
              f"{statistics.mean(values) * 1e3:.1f} | {p90 * 1e3:.1f} |")  # fmt: skip
    ratio = statistics.median(times["responses"]) / statistics.median(times["chat"])
    mean_ratio = statistics.mean(times["responses"]) / statistics.mean(times["chat"])
    print(f"\nresponses / chat: {ratio:.3f} (medians), {mean_ratio:.3f} (means)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server (default: start Sluice)")
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--server-args", default="", help="extra flags for the Sluice it starts")
    args = parser.parse_args()

    async def run() -> dict[str, list[float]]:
        with ExitStack() as stack:
            url = args.url
            if url is None:
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                command = sluice_command(port, None, args.server_args.split())
                await start_ready("sluice", command, Target("sluice", url), LOG_DIR, stack)
            return await measure(url, args.pairs, args.prompt_tokens, args.output_tokens)

    report(asyncio.run(run()))


if __name__ == "__main__":
    main()
