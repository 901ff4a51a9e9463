"""What the engine returns: a delta per request per step (the step API) and whole results (the offline API).

One merge: RequestOutput.absorb coalesces a later delta of a choice into an earlier one. A whole choice
(ChoiceOutput) is all its deltas merged that way, and the HTTP layer builds its responses from ChoiceOutputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.batch import SampledToken


class FinishReason(str, enum.Enum):
    """Why a request ended. A str, so it compares equal to (and serialises as) OpenAI's strings."""

    STOP = "stop"  # EOS, a stop string or a stop token id
    LENGTH = "length"  # max_tokens or the context limit
    TOOL_CALLS = "tool_calls"  # a STOP whose output held tool calls: the web layer reads calls, not the engine
    ABORT = "abort"  # the client left, the server drained, or the client did not read in time
    ERROR = "error"  # this request failed; `error` says why in words fit for the client

    def __str__(self) -> str:
        return self.value


NOT_RUN = "engine_loading"  # an error_code (see RequestOutput.error_code): the web layer answers it as loading


@dataclass(slots=True)
class RequestOutput:
    """One choice's progress in one step. Every choice (index 0 .. n-1) of a request gets exactly one delta with
    finished=True; the request has finished when all n have."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str  # well-formed UTF-8; partial characters and possible stop-string starts are held back
    finished: bool = False
    finish_reason: FinishReason | None = None  # set once finished
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it, if any
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # output tokens so far, this step's included
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[SampledToken] | None = None  # one per new token when the request asked for logprobs
    error: str | None = None  # set when finish_reason == "error"
    # Set with error when the request's own input failed it mid-output (a grammar past its parser's limits): OpenAI's
    # error code for a 400, where an error without one is the engine's (a 500). NOT_RUN: nothing of the request ran
    # and the server cannot run it now (every replica failed before it could): a 503 that says when to try again.
    error_code: str | None = None
    # With the first token, when the request asked for them: one per prompt token (None for the first).
    prompt_logprobs: list[SampledToken | None] | None = None
    index: int = 0  # the choice, among the request's n (SamplingParams.n)

    def absorb(self, later: RequestOutput) -> None:
        """Coalesce a later delta of the same choice into this one, as if both had come in one step."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.new_token_ids.extend(later.new_token_ids)
        self.text_delta += later.text_delta
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = list(later.logprobs)
            else:
                self.logprobs.extend(later.logprobs)
        self.num_prompt_tokens = later.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens = later.num_output_tokens
        # Set once, at the request's first admission: a final delta from outside the engine may not know it.
        self.num_cached_tokens = max(self.num_cached_tokens, later.num_cached_tokens)
        self.finished, self.finish_reason = later.finished, later.finish_reason
        self.stop_reason, self.error, self.error_code = later.stop_reason, later.error, later.error_code


class ChoiceOutput(RequestOutput):
    """One of the n choices of a request, whole: every delta of that choice merged by RequestOutput.absorb, so
    its new_token_ids / text_delta hold the whole output (also named token_ids / text)."""

    __slots__ = ()

    def __init__(self, index: int, request_id: str = "") -> None:
        super().__init__(request_id, [], "", index=index)

    @property
    def text(self) -> str:
        return self.text_delta

    @property
    def token_ids(self) -> list[int]:
        return self.new_token_ids


@dataclass(slots=True)
class CompletionOutput:
    """The whole result of one request, as LLM.generate / LLM.chat return it: its n choices in `outputs`;
    text, token_ids, finish_reason, stop_reason and logprobs are those of the first choice."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[ChoiceOutput] = field(default_factory=lambda: [ChoiceOutput(0)])

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[SampledToken] | None:
        return self.outputs[0].logprobs

    @property
    def prompt_logprobs(self) -> list[SampledToken | None] | None:
        return next((c.prompt_logprobs for c in self.outputs if c.prompt_logprobs is not None), None)

    @property
    def num_cached_tokens(self) -> int:
        return max(choice.num_cached_tokens for choice in self.outputs)

    @property
    def is_finished(self) -> bool:
        return all(choice.finish_reason is not None for choice in self.outputs)

    def absorb(self, delta: RequestOutput) -> None:
        self.outputs[delta.index].absorb(delta)
