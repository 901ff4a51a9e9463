"""Synthetic workloads: prompt and output length distributions, prompts from a fixed local word list."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from bench.words import WORDS

DIST_KINDS = {"fixed": 1, "uniform": 2, "normal": 2, "exp": 1}


@dataclass(frozen=True)
class LengthDist:
    """`128` (fixed), `uniform:64:192`, `normal:128:32` (mean, std) or `exp:128` (mean); samples are >= 1."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        kind, _, rest = spec.partition(":") if ":" in spec else ("fixed", "", spec)
        if kind not in DIST_KINDS:
            raise ValueError(f"unknown length distribution {kind!r} in {spec!r}; use one of {sorted(DIST_KINDS)}")
        try:
            params = [float(p) for p in rest.split(":")]
        except ValueError:
            raise ValueError(f"bad length distribution {spec!r}: parameters must be numbers") from None
        if len(params) != DIST_KINDS[kind]:
            raise ValueError(f"{kind} takes {DIST_KINDS[kind]} parameter(s), got {spec!r}")
        if params[0] < 1 or (kind == "uniform" and params[1] < params[0]) or (kind == "normal" and params[1] < 0):
            raise ValueError(f"bad length distribution {spec!r}")
        return cls(kind, *params)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "uniform":
            value = rng.uniform(self.a, self.b)
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        elif self.kind == "exp":
            value = rng.expovariate(1 / self.a)
        else:
            value = self.a
        return max(1, round(value))

    def __str__(self) -> str:
        params = [self.a] if DIST_KINDS[self.kind] == 1 else [self.a, self.b]
        text = ":".join(f"{p:g}" for p in params)
        return text if self.kind == "fixed" else f"{self.kind}:{text}"


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: str
    prompt_tokens: int  # the target; exact only when a tokenizer was given
    max_tokens: int


class TokenCounter(Protocol):
    def __call__(self, text: str) -> int: ...


def load_token_counter(model_dir: str | Path) -> TokenCounter:
    """Counts tokens with the model's own tokenizer: a folder's tokenizer.json (the `tokenizers` library, no
    transformers import), or the tokenizer of a GGUF's metadata."""
    from tokenizers import Tokenizer

    if str(model_dir).endswith(".gguf"):
        from engine.checkpoint.gguf_file import GGUFCheckpoint

        tokenizer = GGUFCheckpoint(Path(model_dir)).tokenizer().backend_tokenizer
    else:
        tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def make_prompt(words: list[str], target: int, counter: TokenCounter | None) -> str:
    """Words from the list are one token each in common BPE vocabularies; a counter makes the length exact."""
    text = " ".join(words[:target])
    if counter is None:
        return text
    used = list(words[:target])
    for _ in range(8):  # each pass moves at least one word, in practice one or two passes suffice
        count = counter(text)
        if count > target and len(used) > 1:
            used = used[: max(1, len(used) - (count - target))]
        elif count < target:
            used += words[len(used) : len(used) + target - count]
        else:
            break
        text = " ".join(used)
    return text


def build_workload(
    num_requests: int,
    prompt_dist: LengthDist,
    output_dist: LengthDist,
    seed: int = 0,
    shared_prefix: int = 0,
    counter: TokenCounter | None = None,
) -> list[RequestSpec]:
    """Deterministic for a seed, so every server in a comparison gets the same prompts."""
    rng = random.Random(seed)
    prefix = [rng.choice(WORDS) for _ in range(shared_prefix)]
    specs = []
    for index in range(num_requests):
        target = prompt_dist.sample(rng)
        # Twice the words needed, so the token counter can lengthen a prompt whose words merged.
        words = prefix[:target] + [rng.choice(WORDS) for _ in range(2 * target - min(target, shared_prefix))]
        specs.append(RequestSpec(index, make_prompt(words, target, counter), target, output_dist.sample(rng)))
    return specs
