"""What the native step's activation precision costs: perplexity and KL divergence against the float reference.

    python -m bench perplexity [--model FILE.gguf] [--ctx 512] [--llama-perplexity PATH]

The text is tests/data/public_domain.txt (the Declaration of Independence, 1776, and the Gettysburg Address,
1863: public domain). It is cut into chunks of --ctx tokens and, as llama.cpp's llama-perplexity does, each chunk
is run from its start and only its second half is scored (every scored token has at least ctx/2 tokens of
context). The reference is transformers' float32 model on the file's own dequantised weights; the native step runs
in each precision ("exact": int16 activations, "int8": int8 ones) with a bfloat16 KV cache as it serves. Reported
per precision: perplexity, the mean (with its standard error) and the 99th percentile of KL(reference || native)
over the scored positions, and how often the top token agrees. With --llama-perplexity, llama.cpp's own perplexity
on the same file, text and chunking (`-c ctx`, its tokenizer, BOS as the model's metadata says) is printed beside
them, like for like: against its own float32 run of the same weights (the file dequantised into a float32 GGUF), its
perplexity ratio, mean (± its own standard error) and 99th-percentile KL divergence and top-token agreement (its
--kl-divergence).
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import tempfile
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "public_domain.txt"


def chunks_of(ids: list[int], ctx: int) -> list[list[int]]:
    return [ids[i : i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)]


def reference_logits(path: Path, chunks: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    with torch.inference_mode():
        return [model(torch.tensor([c])).logits[0].float() for c in chunks]


def native_logits(path: Path, chunks: list[list[int]], precision: str) -> list[torch.Tensor]:
    from engine.config import EngineConfig
    from engine.kv_pool import layer_shape
    from engine.loader import load_model

    ctx = len(chunks[0])
    block_size = 16
    num_blocks = -(-ctx // block_size)
    loaded = load_model(EngineConfig(model=str(path), precision=precision, num_kv_blocks=num_blocks, block_size=16))
    backend = loaded.backend
    if getattr(backend, "name", "") != "native":
        raise SystemExit("the native step is not built or cannot run this model (make install)")
    shape = layer_shape(backend, num_blocks, block_size)
    k = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(backend.num_layers)]
    v = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(backend.num_layers)]
    backend.bind_kv_caches(k, v)
    positions = torch.arange(ctx, dtype=torch.int64)
    rows = torch.zeros(ctx, dtype=torch.int32)
    table = torch.arange(num_blocks, dtype=torch.int32).view(1, -1)
    out = []
    with torch.inference_mode():
        for c in chunks:
            hidden = backend.run_tokens(torch.tensor(c, dtype=torch.int64), positions, positions, rows, table)
            out.append(backend.compute_logits(hidden))
    return out


def scores(logits: list[torch.Tensor], chunks: list[list[int]], reference: list[torch.Tensor] | None) -> dict:
    """Perplexity over the second half of each chunk; with a reference, KL(ref || these) and top-1 agreement."""
    nll, kls, agree, n = 0.0, [], 0, 0
    for lg, c, ref in zip(logits, chunks, reference or [None] * len(chunks)):
        first = len(c) // 2
        logp = torch.log_softmax(lg[first - 1 : -1].double(), -1)  # predicts tokens first .. end
        target = torch.tensor(c[first:])
        nll -= logp.gather(1, target[:, None]).sum().item()
        n += len(target)
        if ref is not None:
            ref_logp = torch.log_softmax(ref[first - 1 : -1].double(), -1)
            kls.append((ref_logp.exp() * (ref_logp - logp)).sum(-1))
            agree += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
    result = {"ppl": math.exp(nll / n), "tokens": n}
    if kls:
        kl = torch.cat(kls)
        result.update(kl_mean=kl.mean().item(), kl_se=(kl.std() / math.sqrt(len(kl))).item(),
                      kl_p99=kl.quantile(0.99).item(), top1=agree / n)  # fmt: skip
    return result


def llama_perplexity(binary: str, path: Path, ctx: int, *extra: str) -> str:
    run = subprocess.run([binary, "-m", str(path), "-f", str(TEXT), "-c", str(ctx), "-t", "2", "-b", str(ctx), *extra],
                         capture_output=True, text=True, timeout=1800)  # fmt: skip
    return run.stdout + run.stderr


def llama_rows(binary: str, path: Path, ctx: int) -> dict[str, dict]:
    """llama.cpp on its own float reference, like for like: the file with every tensor dequantised to float32 (the same
    weights, no activation quantisation), then the file itself scored against those logits (its --kl-divergence)."""
    from bench.synthetic_gguf import write_float_copy

    with tempfile.TemporaryDirectory() as tmp:
        float_copy, base = write_float_copy(path, Path(tmp) / "float32.gguf"), Path(tmp) / "base.kld"
        llama_perplexity(binary, float_copy, ctx, "--kl-divergence-base", str(base))
        float_copy.unlink()
        text = llama_perplexity(binary, path, ctx, "--kl-divergence-base", str(base), "--kl-divergence")

    def figure(label: str) -> float:
        found = re.search(rf"{re.escape(label)}\s*:\s*(-?[0-9.]+)", text)
        if not found:
            raise SystemExit(f"llama-perplexity printed no {label!r}:\n{text[-2000:]}")
        return float(found.group(1))

    reference, quantised = figure("Mean PPL(base)"), figure("Mean PPL(Q)")
    kl_error = re.search(r"Mean\s+KLD\s*:\s*[0-9.]+\s*±\s*([0-9.]+)", text)
    return {
        "llama.cpp float32 reference (its tokenisation)": {"ppl": reference, "base": reference},
        "llama.cpp on the file": {"ppl": quantised, "base": reference, "kl_mean": figure("Mean    KLD"),
                                  "kl_se": float(kl_error.group(1)) if kl_error else None,
                                  "kl_p99": figure("99.0%   KLD"), "top1": figure("Same top p") / 100},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="a GGUF file (default: the default model)")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--llama-perplexity", default=None, help="llama.cpp's llama-perplexity binary")
    args = parser.parse_args(argv)
    from engine.loader import load_model
    from engine.config import EngineConfig

    loaded = load_model(EngineConfig(model=args.model, quantize="none", dtype="float32", num_kv_blocks=1))
    path, tokenizer = Path(loaded.path), loaded.tokenizer
    del loaded
    ids = tokenizer(TEXT.read_text())["input_ids"]
    chunks = chunks_of(ids, args.ctx)
    print(f"{path.name}: {len(ids)} tokens of {TEXT.name}, {len(chunks)} chunks of {args.ctx}, second halves scored")
    reference = reference_logits(path, chunks)
    rows = {"float32 reference (transformers)": scores(reference, chunks, None)}
    for precision in ("exact", "int8"):
        rows[f"native, precision {precision}"] = scores(native_logits(path, chunks, precision), chunks, reference)
    if args.llama_perplexity:
        rows.update(llama_rows(args.llama_perplexity, path, args.ctx))
    print("| run | perplexity | vs its reference | mean KL ± its standard error | KL p99 | top-1 agrees |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        ppl, base = r["ppl"], r.get("base", rows["float32 reference (transformers)"]["ppl"])
        cells = [f"{ppl:.4f}", f"{(ppl / base - 1) * 100:+.3f}%"]
        if "kl_mean" in r:
            error = f" ± {r['kl_se']:.5f}" if r.get("kl_se") is not None else ""
            cells += [f"{r['kl_mean']:.5f}{error}", f"{r['kl_p99']:.5f}", f"{r['top1']:.4f}"]
        else:
            cells += ["-"] * 3
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
