"""Constrained against unconstrained decoding on the offline engine: the cost of structured outputs.

    python -m bench structured [--streams 1,32] [--prompt-tokens 128] [--output-tokens 128] [--repeats 3]

Each run generates exactly --output-tokens tokens per request, greedy, with the same prompts: unconstrained
(ignore_eos) and constrained by a JSON schema (an array of objects with enum, integer and string fields) that
cannot be complete before max_tokens, so both runs do the same number of steps. The two kinds alternate,
--repeats times each, and the best of each is reported (a shared machine is noisy).
"""

from __future__ import annotations

import argparse
import time

from bench.experiments.offline import make_prompts

SCHEMA = {
    "type": "array",
    "minItems": 100,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "color": {"enum": ["red", "green", "blue"]},
            "label": {"type": "string", "maxLength": 12},
        },
        "required": ["id", "color", "label"],
        "additionalProperties": False,
    },
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="a model path ('' = the default SmolLM2 GGUF)")
    parser.add_argument("--streams", default="1,32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    from engine import LLM, SamplingParams, StructuredOutputs

    streams = [int(s) for s in args.streams.split(",")]
    llm = LLM(args.model, max_num_seqs=max(streams))
    prompts = make_prompts(llm.tokenizer, max(streams), args.prompt_tokens)
    free = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.output_tokens, temperature=0,
                                 structured_outputs=StructuredOutputs(json=SCHEMA))  # fmt: skip

    def tok_s(batch: list[list[int]], params: SamplingParams) -> float:
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.token_ids) == args.output_tokens for o in outs), [o.finish_reason for o in outs]
        return len(batch) * args.output_tokens / elapsed

    tok_s(prompts[:1], free)  # warm-up, and the llguidance tokenizer
    tok_s(prompts[:1], constrained)
    print("| streams | unconstrained tok/s | constrained (JSON schema) tok/s | ratio |")
    print("| --- | --- | --- | --- |")
    for n in streams:
        batch = prompts[:n]
        best_free = best_constrained = 0.0
        for _ in range(args.repeats):
            best_free = max(best_free, tok_s(batch, free))
            best_constrained = max(best_constrained, tok_s(batch, constrained))
        print(f"| {n} | {best_free:.1f} | {best_constrained:.1f} | {best_constrained / best_free:.2f} |", flush=True)


if __name__ == "__main__":
    main()
