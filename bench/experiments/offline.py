"""Offline throughput: Sluice's engine against transformers `generate`, same model, same prompts, one run.

    python -m bench offline [--num-requests 32] [--prompt-tokens 128] [--output-tokens 128]

Reports single-stream decode tokens/s (output tokens after the first, over the time after the first) and
the throughput of a batch of requests (all output tokens over the wall time), with Sluice / transformers ratios.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable

from pathlib import Path

import torch

WORDS = (
    "river stone lantern harbor meadow violet engine signal copper window orbit garden thunder pixel "
    "canyon maple velvet summit glacier ember falcon prairie quartz tundra willow beacon cobalt dune"
).split()


def make_prompts(tokenizer, num_prompts: int, num_tokens: int) -> list[list[int]]:
    """Distinct prompts of exactly num_tokens tokens (no shared prefix to flatter the prefix cache)."""
    prompts = []
    for i in range(num_prompts):
        words = [WORDS[(i * 7 + j * (i + 3)) % len(WORDS)] for j in range(num_tokens)]
        ids = tokenizer.encode(f"Request {i}: " + " ".join(words), add_special_tokens=False)[:num_tokens]
        prompts.append(ids)
    return prompts


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(args, run: Callable[[list[list[int]], int], None], prompts: list[list[int]]) -> dict[str, float]:
    """run(batch, max_tokens) generates exactly max_tokens per prompt. Decode rate excludes the first token."""
    run(prompts[:1], 4)  # warm-up
    t_first = min(timed(lambda: run(prompts[:1], 1)) for _ in range(2))
    t_all = timed(lambda: run(prompts[:1], args.output_tokens))
    t_batch = timed(lambda: run(prompts, args.output_tokens))
    return {
        "single_decode_tok_s": (args.output_tokens - 1) / (t_all - t_first),
        "batch_tok_s": args.num_requests * args.output_tokens / t_batch,
    }


def bench_sluice(args, llm, prompts: list[list[int]]) -> dict[str, float]:
    from engine import SamplingParams

    def run(batch: list[list[int]], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outs = llm.generate(batch, params, use_tqdm=False)
        assert all(len(o.token_ids) == max_tokens for o in outs)

    return measure(args, run, prompts)


def bench_transformers(args, model_dir: str, prompts: list[list[int]]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    path = Path(model_dir)
    # a GGUF: transformers dequantises it itself (the same values Sluice reads)
    where = {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name} if path.suffix == ".gguf" else {
        "pretrained_model_name_or_path": path}
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(**where)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def run(batch: list[list[int]], max_tokens: int) -> None:
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        assert out.shape[1] == width + max_tokens

    return measure(args, run, prompts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--precision", default=None, help="the native step's activations: exact or int8 (config.toml's)")
    args = parser.parse_args(argv)

    from engine import LLM

    precision = {"precision": args.precision} if args.precision else {}
    llm = LLM(dtype=args.dtype, max_num_seqs=max(args.num_requests, 1), enable_prefix_caching=False, **precision)
    model_dir, precision = str(llm.engine.model_path), llm.engine.config.precision
    prompts = make_prompts(llm.tokenizer, args.num_requests, args.prompt_tokens)
    sluice = bench_sluice(args, llm, prompts)
    del llm
    gc.collect()
    hf = bench_transformers(args, model_dir, prompts)
    print(f"model: {model_dir}  dtype: {args.dtype}  precision: {precision}  "
          f"threads: {torch.get_num_threads()}")  # fmt: skip
    print(f"prompts: {args.num_requests} x {args.prompt_tokens} tokens, {args.output_tokens} output tokens, greedy\n")
    print(f"| {'metric':<34} | {'Sluice':>9} | {'transformers':>12} | {'ratio':>6} |")
    print(f"|{'-' * 36}|{'-' * 11}|{'-' * 14}|{'-' * 8}|")
    rows = [
        ("single-stream decode (tok/s)", "single_decode_tok_s"),
        (f"{args.num_requests} requests, throughput (tok/s)", "batch_tok_s"),
    ]
    for label, key in rows:
        print(f"| {label:<34} | {sluice[key]:>9.1f} | {hf[key]:>12.1f} | {sluice[key] / hf[key]:>5.2f}x |")


if __name__ == "__main__":
    main()
