"""How late the event loop is while the engine decodes: the GIL the forward pass holds, measured.

    python -m bench gil [--streams 64] [--output-tokens 128] [--prompt-tokens 128]

Runs the engine's steps in one worker thread (as the server does: anyio.to_thread), keeps `--streams` greedy
requests decoding, and meanwhile samples the event loop: a task asks to wake every millisecond and records how
late it woke. Also reports the share of each step's wall time spent inside the runner's forward pass and logits
calls, which release the GIL when the native step runs. Compare with SLUICE_NATIVE=0 for the eager path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import anyio

from bench.experiments.offline import make_prompts


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(args: argparse.Namespace) -> None:
    from engine import LLM, SamplingParams

    llm = LLM(max_num_seqs=max(args.streams, 1))
    engine = llm.engine
    runner = engine.runner
    inside = [0.0]
    backend = runner.backend
    for name in ("forward", "compute_logits"):
        fn = getattr(backend, name)

        def timed(*a, _fn=fn, **kw):
            start = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                inside[0] += time.perf_counter() - start

        setattr(backend, name, timed)
    prompts = make_prompts(engine.tokenizer, args.streams, args.prompt_tokens)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    while engine.num_running < min(args.streams, len(prompts)):  # prefill everyone first: measure decoding
        await anyio.to_thread.run_sync(engine.step)
    lags: list[float] = []
    done = anyio.Event()

    async def sample_lag() -> None:
        while not done.is_set():
            start = time.perf_counter()
            await anyio.sleep(0.001)
            lags.append((time.perf_counter() - start - 0.001) * 1000)

    limiter = anyio.CapacityLimiter(1)
    inside[0] = 0.0
    steps, start = 0, time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(sample_lag)
        while engine.has_unfinished_requests and steps < args.max_steps:
            await anyio.to_thread.run_sync(engine.step, limiter=limiter)
            steps += 1
        done.set()
    wall = time.perf_counter() - start
    print(f"{backend.name} step; {args.streams} streams decoding, {steps} steps, "
          f"{wall / steps * 1000:.1f} ms a step")
    print(f"time inside the forward pass and logits calls: {inside[0] / wall * 100:.1f}% of the wall time")
    print(f"event-loop lag (ms, {len(lags)} samples): p50 {statistics.median(lags):.2f}  p99 {percentile(lags, 0.99):.2f}  "
          f"max {max(lags):.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--max-steps", type=int, default=100)
    sys.setswitchinterval(0.0005)  # as the server sets it (web/server.py)
    anyio.run(measure, parser.parse_args(argv))


if __name__ == "__main__":
    main()
