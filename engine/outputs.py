"""What the engine returns: a delta per request per step (the step API) and whole results (the offline API)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.batch import SampledToken

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(slots=True)
class RequestOutput:
    """One request's progress in one step. Every request gets exactly one delta with finished=True."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str  # well-formed UTF-8; partial characters and possible stop-string starts are held back
    finished: bool = False
    finish_reason: str | None = None  # one of FINISH_REASONS once finished
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it, if any
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # output tokens so far, this step's included
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[SampledToken] | None = None  # one per new token when the request asked for logprobs
    error: str | None = None  # set when finish_reason == "error"


@dataclass(slots=True)
class CompletionOutput:
    """The whole result of one request, as LLM.generate / LLM.chat return it."""

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    logprobs: list[SampledToken] | None = None

    def absorb(self, delta: RequestOutput) -> None:
        self.text += delta.text_delta
        self.token_ids.extend(delta.new_token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason
            self.num_cached_tokens = delta.num_cached_tokens
