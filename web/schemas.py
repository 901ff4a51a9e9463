"""Request bodies of the OpenAI API, validated strictly (no "5" for 5), turned into SamplingParams.

These models check JSON shapes and types only. The ranges of the sampling parameters are SamplingParams' rule
(engine/sampling_params.py): its InvalidRequest is a 400 naming the parameter as the request spelled it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import InvalidRequest
from engine.input_processor import chat_template_options, join_text_parts
from engine.sampling_params import SamplingParams
from engine.structured_outputs import StructuredOutputs
from web.errors import APIError
from web.ignored_fields import report_ignored_fields
from web.strict_schema import closed_objects
from web.tool_calls import FunctionTool

# allow_inf_nan: a number that overflows JSON to inf (1e999) is a 400, never a value that reaches the sampler.
StrictModel = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = StrictModel
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: every chunk carries the usage so far


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is enforced either way


class ResponseFormatField(BaseModel):
    model_config = StrictModel
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's extra request field: exactly one of json (a schema), regex, choice, grammar (Lark), json_object."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class RequestBody(BaseModel):
    model_config = StrictModel

    def check_supported(self) -> None:
        """400 for what validates but this server does not do."""


class SamplingFields(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions. None means "the default"."""

    model: str | None = None  # the served model (as vLLM: OpenAI requires it, a one-model server need not)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Any] | None = None
    speculative: bool | None = True  # false: this request never speculates (the output is the same either way)
    user: str | None = None
    response_format: ResponseFormatField | None = None
    structured_outputs: StructuredOutputsField | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats, which counts only with include_usage."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        rf = self.response_format
        if rf is not None and rf.type == "json_schema" and (rf.json_schema is None or rf.json_schema.schema_ is None):
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        if rf is not None and rf.type != "text" and self.structured_outputs is not None:
            message = "send either response_format or structured_outputs, not both"
            raise APIError(400, message, param="structured_outputs")

    def constraint(self) -> StructuredOutputs | None:
        """What the output must match, from response_format or structured_outputs (InvalidRequest if malformed)."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type == "json_object":
            return StructuredOutputs(json_object=True, param="response_format")
        if rf is not None and rf.type == "json_schema":
            assert rf.json_schema is not None
            schema = rf.json_schema.schema_
            return StructuredOutputs(json=closed_objects(schema) if rf.json_schema.strict else schema,
                                     param="response_format")  # fmt: skip
        if so is None:
            return None
        return StructuredOutputs(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                 json_object=bool(so.json_object))  # fmt: skip

    def wire_names(self) -> dict[str, str]:
        """SamplingParams' field -> the request's name for it, where they differ (max_completion_tokens,
        top_logprobs): what an InvalidRequest about the field names."""
        return {}

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """InvalidRequest (400, naming the parameter) for values the engine cannot honour."""
        return checked_sampling_params(
            self.wire_names(),
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
            structured_outputs=self.constraint(),
            speculative=_default(self.speculative, True),
        )


class TextPart(BaseModel):
    """A text part, or an assistant's refusal part (OpenAI's two kinds of assistant content), read as its text
    as vLLM reads it."""

    model_config = StrictModel
    type: Literal["text", "refusal"]
    text: str | None = None
    refusal: str | None = None

    @property
    def field(self) -> str:
        return "text" if self.type == "text" else "refusal"

    @property
    def content(self) -> str | None:
        return self.text if self.type == "text" else self.refusal


class FunctionCallIn(BaseModel):
    model_config = StrictModel
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    model_config = StrictModel
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    model_config = StrictModel
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = join_text_parts(part.content or "" for part in content)
        # The chat templates of small models know "system" but not OpenAI's newer "developer".
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            # Templates write arguments with `| tojson`: they want the object, not its JSON text.
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls  # fmt: skip
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and role == "tool":
            message["name"] = self.name
        return message


class FunctionSpec(BaseModel):
    model_config = StrictModel
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments are constrained whenever a call is: strict or not


class ToolSpec(BaseModel):
    model_config = StrictModel
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = StrictModel
    name: str


class NamedToolChoice(BaseModel):
    model_config = StrictModel
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateFields(BaseModel):
    """vLLM's chat template switches and variables (engine.input_processor.chat_template_options)."""

    model_config = StrictModel
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def template_options(self) -> dict[str, Any]:
        return chat_template_options(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs)

    def check_template_switches(self) -> None:
        """vLLM's rule: both switches sent true are a 400 (the generation prompt is on by default: only when sent)."""
        is_sent = "add_generation_prompt" in self.model_fields_set
        if self.continue_final_message and self.add_generation_prompt and is_sent:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true: the final "
                           "message is either continued or followed by a new turn",
                           param="continue_final_message")  # fmt: skip


def check_messages(messages: list[ChatMessage]) -> None:
    """400 for a message OpenAI refuses: a part without the text its type calls for ("text" of a text part,
    "refusal" of a refusal), no content, a tool result without its id."""
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else []):
            if part.content is None:
                param = f"messages.{i}.content.{j}.{part.field}"
                raise APIError(400, f"{param}: Field required", param=param)
        # OpenAI's rule: only an assistant's message that made tool calls may come without content
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise APIError(400, f"messages.{i}.content: required in a message of role {message.role!r}",
                           param=f"messages.{i}.content")  # fmt: skip
        if message.role == "tool" and message.tool_call_id is None:  # OpenAI's rule too
            raise APIError(400, f"messages.{i}.tool_call_id: required in a message of role 'tool' (the id of the "
                           "tool call it answers)", param=f"messages.{i}.tool_call_id")  # fmt: skip


# More messages than any context holds: refused as the list is read (validating 140,000 held the loop ~0.8 s).
MAX_MESSAGES = 8192


class ToolsField(BaseModel):
    model_config = StrictModel
    tools: list[ToolSpec] | None = Field(None, max_length=128)

    def function_tools(self) -> list[FunctionTool]:
        return [
            FunctionTool(t.function.name, t.function.description, closed_objects(t.function.parameters or {}))
            for t in self.tools or []
        ]


class ChatCompletionRequest(SamplingFields, ChatTemplateFields, ToolsField):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    functions: list[Any] | None = None
    function_call: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.functions:
            raise APIError(400, "functions are not supported by this server: use tools", param="functions")
        if self.function_call not in (None, "none", "auto"):
            raise APIError(400, "function_call is not supported by this server: use tool_choice", param="function_call")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        check_messages(self.messages)
        self.check_template_switches()
        choice, name = self.tool_choice_kind()
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise APIError(400, "tool names must be unique", param="tools")
        if choice in ("required", "function") and not names:
            raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        if choice == "function" and name not in names:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        so = self.structured_outputs
        is_json = so is None or all(v is None for v in (so.regex, so.choice, so.grammar))
        if choice != "none" and names and not is_json:
            raise APIError(400, "structured_outputs regex / choice / grammar cannot be combined with tools unless "
                           "tool_choice is 'none' (a JSON schema or json_object can)",
                           param="structured_outputs")  # fmt: skip

    def tool_choice_kind(self) -> tuple[str, str | None]:
        """("none" | "auto" | "required" | "function", the named function). OpenAI's default: auto with tools."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "function", choice.function.name
        if choice is None:
            return ("auto" if self.tools else "none"), None
        return choice, None

    def wire_names(self) -> dict[str, str]:
        if self.max_completion_tokens is not None:
            return {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"}
        return {"logprobs": "top_logprobs"}

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.stream and self.echo:
            raise APIError(400, "echo is supported without stream only", param="echo")
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
        # OpenAI's legacy default for /v1/completions is 16 tokens; an explicit null is the rest of the context, as
        # in vLLM (and as chat's default). With echo, logprobs cover the prompt too.
        prompt_logprobs = self.logprobs if self.echo else None
        is_omitted = "max_tokens" not in self.model_fields_set
        max_tokens = 16 if is_omitted else self.max_tokens
        return self.sampling_params(max_tokens, self.logprobs, prompt_logprobs)

    def wire_names(self) -> dict[str, str]:
        return {"prompt_logprobs": "logprobs"}


class TokenizeRequest(RequestBody, ChatTemplateFields, ToolsField):
    """/tokenize, as vLLM's: a prompt, or chat messages (and tools) through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    return_token_strs: bool = False

    def check_supported(self) -> None:
        check_messages(self.messages or [])  # the messages chat would take, no others
        self.check_template_switches()
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
        # A union's members each fail (content as a string, then as a list of parts): the deepest failure is the
        # one the client meant ("messages.0.content.0.type", not "messages.0.content: should be a string").
        errors = error.errors()
        first = max(errors, key=lambda e: len(e["loc"]))
        param = _param_from_loc(first["loc"])
        where = f"{param}: " if param else ""
        raise APIError(400, f"{where}{validation_message(errors, first)}"[:500], param=param) from None
    report_ignored_fields(model, body)
    request.check_supported()
    return request


def validation_message(errors: list[Any], first: Any) -> str:
    """What pydantic's error `first` (one of `errors`) says, as every endpoint words it: a value of no type of a union
    names each type, an integer past 64 bits says so."""
    return _union_message(errors, first, _param_from_loc(first["loc"]))


def _union_message(errors: list[Any], first: Any, param: str | None) -> str:
    """first's message, or, where a value is of no type a union takes (every member failed on its type at the same
    place: `"input": 5`), each type it could be ("should be a valid string or a valid list", not only the first)."""
    members = [e for e in errors if len(e["loc"]) == len(first["loc"]) and _param_from_loc(e["loc"]) == param]
    prefix = "Input should be "
    if len(members) < 2 or not all(e["type"].endswith("_type") and e["msg"].startswith(prefix) for e in members):
        return _error_message(first)
    return prefix + " or ".join(dict.fromkeys(e["msg"].removeprefix(prefix) for e in members))


def _error_message(error: Any) -> str:
    value = error.get("input")
    if error["type"] == "literal_error" and isinstance(value, str):
        return f"{error['msg']}, got {value!r}"
    if error["type"] == "int_type" and isinstance(value, float) and value.is_integer() and abs(value) >= 2**63:
        return "Input should be an integer within 64 bits"  # the JSON parser reads larger ones as floats
    return _CLASS_NAME.sub("", error["msg"])  # "a valid dictionary or instance of ChatMessage": the class is ours


# pydantic puts the member of a union it tried into `loc` ("str", "list[int]", a model's class: "NamedToolChoice"):
# not part of the path. The request's own names are snake_case; a client's CamelCase key (of metadata) is named
# by its object.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|[A-Z][A-Za-z0-9]*|.*[\[\-].*)$")
_CLASS_NAME = re.compile(r" or instance of [A-Za-z0-9_]+")


def _param_from_loc(loc: tuple[int | str, ...]) -> str | None:
    parts = [str(p) for p in loc if isinstance(p, int) or not _TYPE_TAG.match(p)]
    return ".".join(parts) or None


def checked_sampling_params(wire_names: dict[str, str], **values: Any) -> SamplingParams:
    """SamplingParams(**values), whose InvalidRequest names the parameter as the request spells it."""
    with named_as_sent(wire_names):
        return SamplingParams(**values)


@contextmanager
def named_as_sent(wire_names: dict[str, str]) -> Iterator[None]:
    """An InvalidRequest raised inside names the parameter as the request spells it (wire_names: SamplingParams'
    field -> the request's name, where they differ)."""
    try:
        yield
    except InvalidRequest as error:
        wire_name = wire_names.get(error.param or "")
        if wire_name is None:
            raise
        raise InvalidRequest(error.message.replace(str(error.param), wire_name), wire_name, error.code) from None


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
