"""n choices of one prompt in one request, against the same n as separate requests, on a running server.

    python -m bench parallel-sampling [--url http://127.0.0.1:8000] [--n 8] [--prompt-tokens 128]
                                      [--output-tokens 128] [--repeats 3]

Three ways to get n completions of one prompt, each exactly --output-tokens long (ignore_eos, seeded
sampling), timed end to end (non-streaming), the median of --repeats rounds (each way first in turn):
- one request with `n`;
- n requests one after another (what a client without `n` does);
- n requests at once (a client with n connections).
The prompt is the same every time, so the separate requests get prefix-cache hits where the server has them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from bench.words import WORDS


def prompt_of(num_tokens: int, seed: int) -> str:
    words = list(WORDS)
    random.Random(seed).shuffle(words)
    return " ".join((words * (num_tokens // len(words) + 1))[:num_tokens])


def complete(client: httpx.Client, body: dict, n: int) -> int:
    response = client.post("/v1/completions", json={**body, "n": n}, timeout=600)
    response.raise_for_status()
    data = response.json()
    assert len(data["choices"]) == n, data
    return data["usage"]["completion_tokens"]


def one_request(client: httpx.Client, body: dict, n: int) -> int:
    return complete(client, body, n)


def sequential(client: httpx.Client, body: dict, n: int) -> int:
    return sum(complete(client, {**body, "seed": body["seed"] + i}, 1) for i in range(n))


def concurrent(client: httpx.Client, body: dict, n: int) -> int:
    with ThreadPoolExecutor(n) as pool:
        return sum(pool.map(lambda i: complete(client, {**body, "seed": body["seed"] + i}, 1), range(n)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", "--base-url", dest="url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the first model /v1/models lists")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    with httpx.Client(base_url=args.url, limits=httpx.Limits(max_connections=args.n + 1)) as client:
        model = args.model or client.get("/v1/models").json()["data"][0]["id"]
        body = {
            "model": model,
            "prompt": prompt_of(args.prompt_tokens, seed=0),
            "max_tokens": args.output_tokens,
            "ignore_eos": True,
            "temperature": 1.0,
            "seed": 1,
        }
        complete(client, {**body, "max_tokens": 4}, 1)  # warm-up
        ways = {"one request with n": one_request, "n requests, one after another": sequential,
                "n requests at once": concurrent}  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in ways}
        names = list(ways)
        for r in range(args.repeats):
            for name in names[r % 3 :] + names[: r % 3]:  # each way first in turn: the machine's load drifts
                way = ways[name]
                start = time.perf_counter()
                tokens = way(client, body, args.n)
                times[name].append(time.perf_counter() - start)
                assert tokens == args.n * args.output_tokens, (name, tokens)
                print(f"{name}: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
    base = statistics.median(times["one request with n"])
    print(f"n={args.n}, prompt ~{args.prompt_tokens} tokens, {args.output_tokens} output tokens each, "
          f"median of {args.repeats}\n")  # fmt: skip
    print(f"| {'way':<30} | {'seconds':>8} | {'out tok/s':>9} | {'vs one request with n':>21} |")
    print(f"|{'-' * 32}|{'-' * 10}|{'-' * 11}|{'-' * 23}|")
    for name in ways:
        seconds = statistics.median(times[name])
        rate = args.n * args.output_tokens / seconds
        print(f"| {name:<30} | {seconds:>8.2f} | {rate:>9.1f} | {seconds / base:>20.2f}x |")


if __name__ == "__main__":
    main()
