"""Per-request sampling parameters, validated on construction (InvalidRequest, a ValueError, on bad input).

This is the one place of the rules: the HTTP schemas (web/schemas.py) only check JSON types and build a
SamplingParams, whose InvalidRequest becomes a 400 naming the OpenAI parameter. Ranges follow the OpenAI API
where it has one (temperature, top_p, penalties, logit_bias, n) and vLLM's extras otherwise. Every value
accepted is one the sampler can honour in bounded time: numbers must be finite, and the lists a request
brings are bounded, because the engine loop checks them on every generated token.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from engine.errors import InvalidRequest
from engine.structured_outputs import StructuredOutputs

MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0  # OpenAI's bound
# OpenAI allows 4 stop strings; vLLM has no bound. Matching runs on the event loop for every generated token,
# so the bound keeps that work small: 16 strings of up to 256 characters.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# OpenAI's bounds: a bias in [-100, 100] per token (-100 bans, 100 forces in practice), at most 300 tokens.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 300
# Choices per request (OpenAI's bound); the input processor also holds n to max_num_seqs.
MAX_N = 128


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _builtin(value: object) -> object:
    """numpy's integer and float scalars as Python's int and float (a seed drawn with np.random, a max_tokens computed
    with numpy), as token ids are taken; bools (numpy's too) and anything else as they are, for the checks to judge."""
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):  # numpy's bool_ is no Integral
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


_NUMBER_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "logprobs", "prompt_logprobs", "n")  # fmt: skip


def _is_unicode(text: str) -> bool:
    """Whether text can be UTF-8 (no lone surrogate), as every generated text is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _require(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise InvalidRequest(message, param=param)


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None = up to the context limit
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 (or 0) = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None = no logprobs; N = sampled token plus the top N (N <= 20)
    # None = none; N = each prompt token's logprob plus the top N at its position. Such a request skips
    # the prefix cache: every prompt position must be computed to be scored.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # token id -> bias added to its logit before sampling. JSON's string keys ("50256") are accepted and
    # become ints; ids are checked against the vocabulary by the input processor.
    logit_bias: dict[int, float] | None = None
    n: int = 1  # independent completions of one prompt, sharing its prefill (seed + i for choice i)
    # The output must match this (a JSON schema, a regex, a choice, a grammar): enforced token by token.
    structured_outputs: StructuredOutputs | None = None
    # False: never guess this request's next tokens (engine/speculative/); the output is the same either way.
    speculative: bool = True

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """InvalidRequest naming the first field the engine cannot honour; normalises stop, stop_token_ids and
        logit_bias. Run again when a request is added: the fields may have been changed since."""
        for name in _NUMBER_FIELDS:
            setattr(self, name, _builtin(getattr(self, name)))
        max_tokens, min_tokens = self.max_tokens, self.min_tokens
        _require(max_tokens is None or (_is_int(max_tokens) and max_tokens >= 1), "max_tokens",
                 f"max_tokens must be an integer >= 1, got {max_tokens!r}")  # fmt: skip
        _require(_is_int(min_tokens) and min_tokens >= 0, "min_tokens",
                 f"min_tokens must be an integer >= 0, got {min_tokens!r}")  # fmt: skip
        _require(max_tokens is None or min_tokens <= max_tokens, "min_tokens",
                 f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})")  # fmt: skip
        _require(_is_number(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
                 f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")  # fmt: skip
        _require(_is_int(self.top_k) and self.top_k >= -1, "top_k",
                 f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")  # fmt: skip
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        _require(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        # a 64-bit signed integer, as vLLM takes: -1 and 2^64 - 1 were the same seed
        _require(self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**63), "seed",
                 f"seed must be an integer from -2^63 to 2^63 - 1, got {self.seed!r}")  # fmt: skip
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_number(value) and -2 <= value <= 2, name, f"{name} must be in [-2, 2], got {value!r}")
        _require(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
                 f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")  # fmt: skip
        _require(isinstance(self.speculative, bool), "speculative",
                 f"speculative must be a boolean, got {self.speculative!r}")  # fmt: skip
        self._check_stops()
        self._check_structured_outputs()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS), name,
                     f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")  # fmt: skip
        self._check_logit_bias()
        _require(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        _require(self.n == 1 or self.prompt_logprobs is None, "n",
                 "prompt logprobs (echo with logprobs) are supported with n=1 only")  # fmt: skip

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if not bias:
            self.logit_bias = None
            return
        _require(isinstance(bias, dict), "logit_bias", "logit_bias must map token ids to numbers")
        _require(len(bias) <= MAX_LOGIT_BIAS_TOKENS, "logit_bias",
                 f"logit_bias may name at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}")  # fmt: skip
        checked: dict[int, float] = {}
        for key, value in bias.items():
            is_id_text = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 20  # int(): 4,300 digits
            token_id = int(key) if is_id_text else _builtin(key)
            value = _builtin(value)
            _require(_is_int(token_id) and token_id >= 0, "logit_bias",
                     f"logit_bias keys must be token ids (non-negative integers), got {repr(key)[:40]}")  # fmt: skip
            _require(_is_number(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS, "logit_bias",
                     f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {key!r}")  # fmt: skip
            checked[token_id] = float(value)
        self.logit_bias = checked

    def _check_structured_outputs(self) -> None:
        structured = self.structured_outputs
        if structured is None:
            return
        _require(isinstance(structured, StructuredOutputs), "structured_outputs",
                 "structured_outputs must be a StructuredOutputs")  # fmt: skip
        # min_tokens bans EOS where the grammar may demand it: the two could leave no token to sample.
        _require(self.min_tokens == 0, "min_tokens", "min_tokens cannot be combined with structured outputs")

    def _check_stops(self) -> None:
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            _require(isinstance(getattr(self, name), bool), name, f"{name} must be true or false")
        if self.stop_token_ids is None:  # vLLM's default
            self.stop_token_ids = []
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        stop = self.stop
        _require(isinstance(stop, list) and all(isinstance(s, str) for s in stop), "stop",
                 "stop must be a string or a list of strings")  # fmt: skip
        _require(len(stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        _require(all(s for s in stop), "stop", "stop strings must not be empty")
        _require(all(_is_unicode(s) for s in stop), "stop",
                 "stop strings must be valid Unicode text (a lone surrogate can never be generated)")  # fmt: skip
        _require(all(len(s) <= MAX_STOP_STRING_CHARS for s in stop), "stop",
                 f"each stop string must have at most {MAX_STOP_STRING_CHARS} characters")  # fmt: skip
        if isinstance(self.stop_token_ids, list):
            self.stop_token_ids = [_builtin(t) for t in self.stop_token_ids]
        ids = self.stop_token_ids
        _require(isinstance(ids, list) and all(_is_int(t) and t >= 0 for t in ids), "stop_token_ids",
                 "stop_token_ids must be a list of non-negative integers")  # fmt: skip
        _require(len(ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
                 f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(ids)}")  # fmt: skip
