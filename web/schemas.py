"""Request bodies of the OpenAI API, validated strictly (no "5" for 5), turned into SamplingParams."""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from web.errors import APIError

# allow_inf_nan: a number that overflows JSON to inf (1e999) is a 400, never a value that reaches the sampler.
StrictModel = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = StrictModel
    include_usage: bool | None = False


class RequestBody(BaseModel):
    model_config = StrictModel

    def check_supported(self) -> None:
        """400 for what validates but this server does not do."""


class SamplingFields(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions. None means "the default"."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """InvalidRequest (400, naming the parameter) for values the engine cannot honour."""
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=_default(self.min_tokens, 0),
            temperature=_default(self.temperature, 1.0),
            top_k=_default(self.top_k, -1),
            top_p=_default(self.top_p, 1.0),
            min_p=_default(self.min_p, 0.0),
            seed=self.seed,
            presence_penalty=_default(self.presence_penalty, 0.0),
            frequency_penalty=_default(self.frequency_penalty, 0.0),
            repetition_penalty=_default(self.repetition_penalty, 1.0),
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=_default(self.skip_special_tokens, True),
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=self.logit_bias,
            n=_default(self.n, 1),
        )


class TextPart(BaseModel):
    model_config = StrictModel
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = StrictModel
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # The chat templates of small models know "system" but not OpenAI's newer "developer".
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise APIError(400, f"{name} are not supported by this server", param=name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none", "auto"):
                raise APIError(400, f"{name} is not supported by this server", param=name)
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format {'type': 'text'} is supported", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.stream and self.echo:
            raise APIError(400, "echo is supported without stream only", param="echo")
        if self.stream and len(self.prompts()) > 1:
            raise APIError(400, "a stream takes one prompt: send several prompts without stream", param="prompt")
        if self.best_of not in (None, 1):
            raise APIError(400, "only best_of=1 is supported", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")

    def prompts(self) -> list[str | list[int]]:
        """One prompt (a string or token ids) or a batch of them: one choice each, in order."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]

    def to_sampling_params(self) -> SamplingParams:
        # OpenAI's legacy default for /v1/completions is 16 tokens. With echo, logprobs cover the prompt too.
        prompt_logprobs = self.logprobs if self.echo else None
        return self.sampling_params(self.max_tokens if self.max_tokens is not None else 16, self.logprobs, prompt_logprobs)


class TokenizeRequest(RequestBody):
    """/tokenize, as vLLM's: a prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "send either prompt or messages", param="prompt")
        if self.messages is not None and not self.messages:
            raise APIError(400, "messages must not be empty", param="messages")


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


RequestModel = TypeVar("RequestModel", bound=RequestBody)


def parse_request(model: type[RequestModel], body: Any) -> RequestModel:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        param = _param_from_loc(first["loc"])
        where = f"{param}: " if param else ""
        raise APIError(400, f"{where}{first['msg']}", param=param) from None
    request.check_supported()
    return request


# pydantic puts the member of a union it tried into `loc` ("str", "list[int]", ...): not part of the path.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|.*[\[\-].*)$")


def _param_from_loc(loc: tuple[int | str, ...]) -> str | None:
    parts = [str(p) for p in loc if isinstance(p, int) or not _TYPE_TAG.match(p)]
    return ".".join(parts) or None


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value
