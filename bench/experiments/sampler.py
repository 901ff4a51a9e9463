"""The sampler's two paths in one process, in turns: the native extension's `sample_rows` / `argmax_rows` and the
PyTorch path.

    python -m bench sampler [--vocab 49152,262144] [--rows 1,8,32] [--calls 200]

Per vocabulary size, row count and parameter set (greedy; temperature 1; temperature 0.7 with top-p 0.9), the best
time of `Sampler()(logits, rows)` on random logits (scale 3) over a few rounds of `--calls` calls, 2 threads as the
server.
"""

from __future__ import annotations

import argparse
import time

PARAMS = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7, top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
}


def sampling_row(**overrides: float):
    from engine.batch import SamplingRow

    fields = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                  repetition_penalty=1.0, seed=None, num_logprobs=None, num_output_tokens=0, prompt_token_ids=[],
                  output_token_ids=[])  # fmt: skip
    fields.update(overrides)
    return SamplingRow(**fields)


def best_ms(call, calls: int, rounds: int = 2) -> float:
    call()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", default="49152,262144")
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--calls", type=int, default=200, help="calls per round at 49k columns and one row")
    args = parser.parse_args(argv)
    import torch

    from engine import sampler as sampler_module
    from engine.native import native_ops

    if native_ops() is None:
        raise SystemExit("the native step is not built (make install builds it)")
    torch.set_num_threads(2)
    native = sampler_module._native_ops
    sampler = sampler_module.Sampler(seed=0)
    print("| vocabulary | rows | parameters | PyTorch ms | native ms | ratio |")
    print("|---|---|---|---|---|---|")
    for vocab in (int(v) for v in args.vocab.split(",")):
        for num_rows in (int(r) for r in args.rows.split(",")):
            logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
            calls = max(3, args.calls * 49152 // (vocab * num_rows))
            for name, params in PARAMS.items():
                rows = [sampling_row(**params) for _ in range(num_rows)]
                times: dict[str, float] = {}
                try:
                    for path in ("torch", "native", "torch", "native"):
                        sampler_module._native_ops = (lambda: None) if path == "torch" else native
                        ms = best_ms(lambda: sampler(logits, rows), calls)
                        times[path] = min(times.get(path, ms), ms)
                finally:
                    sampler_module._native_ops = native
                torch_ms, native_ms = times["torch"], times["native"]
                print(f"| {vocab} | {num_rows} | {name} | {torch_ms:.3f} | {native_ms:.3f} | {torch_ms / native_ms:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
