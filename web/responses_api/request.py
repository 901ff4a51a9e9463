"""The body of POST /v1/responses, validated strictly: what this server does, and a 400 naming the parameter
for what it does not (built-in tools, background, images, ...). Input items become canonical items (see
web/responses_api/conversation.py); nothing here touches the engine."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.input_processor import join_text_parts
from engine.sampling_params import SamplingParams
from engine.structured_outputs import StructuredOutputs
from web.errors import APIError
from web.ignored_fields import report_ignored_fields
from web.responses_api.conversation import Item, function_call, function_call_output, message
# _TYPE_TAG: union members pydantic puts in `loc`
from web.schemas import _TYPE_TAG, FunctionSpec, NamedFunction, StrictModel, checked_sampling_params, validation_message
from web.strict_schema import closed_objects
from web.tool_calls import FunctionTool

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_INPUT_ITEMS = 4096
# include values that ask for nothing this server could add (it keeps no reasoning to encrypt).
HARMLESS_INCLUDES = frozenset({"reasoning.encrypted_content"})
# The response repeats text.format's schema and the tools' parameters, compiled or not (tool_choice "none" compiles
# no tool; calls only compile no answer format): orjson writes no JSON deeper than 254 levels, the event and the
# response around the schema included, and llguidance compiles no schema deeper than 128 (serde_json's limit).
MAX_SCHEMA_LEVELS = 128


class ContentPart(BaseModel):
    model_config = StrictModel
    type: str
    text: str | None = None
    refusal: str | None = None  # a refusal part's text (an assistant's output message, sent back as input)


class MessageItem(BaseModel):
    model_config = StrictModel
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(BaseModel):
    model_config = StrictModel
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = StrictModel
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class FunctionToolSpec(FunctionSpec):
    """The Responses API's function tool: the chat API's function spec, flat beside its type."""

    type: Literal["function"]


class FunctionChoice(NamedFunction):
    type: Literal["function"]


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = StrictModel
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(BaseModel):
    model_config = StrictModel

    model: str | None = None  # the served model, as in chat and completions
    input: str | list[Any]  # items are checked one by one (input_items), to name the one at fault
    instructions: str | None = None
    max_output_tokens: int | None = None  # the ranges of these three are SamplingParams' (one rule)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    conversation: Any = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None  # no reasoning to tune: accepted and ignored
    speculative: bool | None = True  # Sluice's, as on chat and completions: false, this request never speculates

    @field_validator("store", "parallel_tool_calls", mode="before")
    @classmethod
    def _null_is_true(cls, value: Any) -> Any:
        """null is the default (true), as for every other field; read as false, it silently stored nothing."""
        return True if value is None else value

    def check_supported(self) -> None:
        unsupported = [
            (bool(self.background), "background", "background responses are not supported: send background: false"),
            (self.conversation is not None, "conversation", "conversations are not supported: use previous_response_id"),
            (self.prompt is not None, "prompt", "stored prompt templates are not supported: send input"),
            (self.truncation == "auto", "truncation", "truncation 'auto' is not supported: the input must fit the context"),
            (bool(self.top_logprobs), "top_logprobs", "logprobs are not supported on /v1/responses"),
        ]  # fmt: skip
        for is_set, param, text in unsupported:
            if is_set:
                raise APIError(400, text, param=param)
        for value in self.include or []:
            if value not in HARMLESS_INCLUDES:
                raise APIError(400, f"include {value!r} is not supported by this server", param="include")
        if isinstance(self.input, str) and not self.input:
            raise APIError(400, "input must not be empty", param="input")
        if isinstance(self.input, list) and len(self.input) > MAX_INPUT_ITEMS:
            raise APIError(400, f"input has {len(self.input)} items, at most {MAX_INPUT_ITEMS}", param="input")
        self._check_metadata()
        fmt = self.text_format()
        if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
            raise APIError(400, "text.format json_schema needs a schema", param="text.format.schema")
        schemas = [("text.format.schema", fmt.schema_ if fmt is not None else None)]
        schemas += [(f"tools[{i}].parameters", tool.get("parameters")) for i, tool in enumerate(self.tools or [])]
        for param, schema in schemas:
            if _levels(schema) > MAX_SCHEMA_LEVELS:
                raise APIError(400, f"{param} nests deeper than {MAX_SCHEMA_LEVELS} levels", param=param)
        choice, name = self.tool_choice_kind()
        names = [t.name for t in self.function_tools_specs()]
        if len(set(names)) != len(names):
            raise APIError(400, "tool names must be unique", param="tools")
        if choice in ("required", "function") and not names:
            raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        if choice == "function" and name not in names:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")

    def _check_metadata(self) -> None:
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA_PAIRS:
            raise APIError(400, f"metadata has {len(metadata)} pairs, at most {MAX_METADATA_PAIRS}", param="metadata")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                message = (f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters and values at most "
                           f"{MAX_METADATA_VALUE_CHARS}")  # fmt: skip
                raise APIError(400, message, param="metadata")

    def text_format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None

    def function_tools_specs(self) -> list[FunctionToolSpec]:
        specs = []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind != "function":
                message = f"tools[{i}]: the tool type {kind!r} is not supported by this server: only 'function' tools"
                raise APIError(400, message, param=f"tools[{i}].type")
            specs.append(_validate(FunctionToolSpec, tool, f"tools[{i}]"))
        return specs

    def function_tools(self) -> list[FunctionTool]:
        return [FunctionTool(t.name, t.description, closed_objects(t.parameters or {})) for t in self.function_tools_specs()]

    def tool_choice_kind(self) -> tuple[str, str | None]:
        """("none" | "auto" | "required" | "function", the named function). The API's default: auto with tools."""
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function":
                message = f"tool_choice of type {choice.get('type')!r} is not supported: 'none', 'auto', " \
                          "'required' or a function"  # fmt: skip
                raise APIError(400, message, param="tool_choice")
            return "function", _validate(FunctionChoice, choice, "tool_choice").name
        if choice is None:
            return ("auto" if self.tools else "none"), None
        return choice, None

    def tool_choice_echo(self) -> str | dict[str, Any]:
        if self.tool_choice is None:
            return "auto"  # the API's default, shown as OpenAI shows it with or without tools
        kind, name = self.tool_choice_kind()
        return {"type": "function", "name": name} if kind == "function" else kind

    def input_items(self) -> list[Item]:
        """The input as canonical items; a 400 naming input[i] for an item or part this server cannot take."""
        if isinstance(self.input, str):
            return [message("user", self.input)]
        items = [_input_item(raw, f"input[{i}]") for i, raw in enumerate(self.input)]
        return [item for item in items if item is not None]

    def constraint(self) -> StructuredOutputs | None:
        fmt = self.text_format()
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputs(json_object=True, param="text.format")
        schema = closed_objects(fmt.schema_) if fmt.strict else fmt.schema_
        return StructuredOutputs(json=schema, param="text.format.schema")

    def wire_names(self) -> dict[str, str]:
        """SamplingParams' field -> this request's name for it: what an InvalidRequest about the field names."""
        return {"max_tokens": "max_output_tokens"}

    def to_sampling_params(self) -> SamplingParams:
        """InvalidRequest (400, naming the parameter) for values the engine cannot honour."""
        return checked_sampling_params(
            self.wire_names(),
            max_tokens=self.max_output_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            structured_outputs=self.constraint(),
            speculative=self.speculative is not False,
        )


def _levels(value: Any) -> int:
    """How deeply objects and arrays nest in value (0 for a scalar), walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def parse_responses_request(body: Any) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    request: ResponsesRequest = _validate(ResponsesRequest, body, "")
    report_ignored_fields(ResponsesRequest, body)
    request.check_supported()
    return request


def _validate(model: type[BaseModel], raw: Any, where: str) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        errors = error.errors()
        first = errors[0]
        param = (where + _param_path(first["loc"])).lstrip(".")
        text = validation_message(errors, first)
        raise APIError(400, f"{param}: {text}" if param else text, param=param or None) from None


def _param_path(loc: tuple[int | str, ...]) -> str:
    """('input', 2, 'role') -> '.input[2].role' (joined to its parent's path; the leading dot is dropped at the top)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _TYPE_TAG.match(part):
            path += f".{part}"
    return path


def _input_item(raw: Any, where: str) -> Item | None:
    """The canonical item, keeping the id the client gave it (GET .../input_items shows it); None for a reasoning
    item (a past response's thought, sent back as clients send their output items): templates drop past thoughts."""
    if not isinstance(raw, dict):
        raise APIError(400, f"{where}: an input item must be an object, not {type(raw).__name__}", param=where)
    if raw.get("type") == "reasoning":
        return None
    item = _canonical_item(raw, where)
    if isinstance(raw.get("id"), str) and raw["id"]:
        item["id"] = raw["id"]
    return item


def _canonical_item(raw: dict[str, Any], where: str) -> Item:
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind == "message":
        item = _validate(MessageItem, raw, where)
        return message(item.role, _text_of(item.content, f"{where}.content"))
    if kind == "function_call":
        call = _validate(FunctionCallItem, raw, where)
        return function_call(call.call_id, call.name, call.arguments)
    if kind == "function_call_output":
        result = _validate(FunctionCallOutputItem, raw, where)
        return function_call_output(result.call_id, _text_of(result.output, f"{where}.output"))
    if kind == "item_reference":
        raise APIError(400, f"{where}: item references are not supported: send the item itself, or use "
                       "previous_response_id", param=f"{where}.type")  # fmt: skip
    raise APIError(400, f"{where}: input items of type {kind!r} are not supported: messages, function_call and "
                   "function_call_output", param=f"{where}.type")  # fmt: skip


TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text", "refusal"})  # a refusal reads as its text (vLLM)


def _text_of(content: str | list[ContentPart], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.type not in TEXT_PART_TYPES:
            message_ = f"{where}[{i}]: content of type {part.type!r} is not supported: this model reads input_text"
            raise APIError(400, message_, param=f"{where}[{i}].type")
        field = "refusal" if part.type == "refusal" else "text"
        text = part.refusal if part.type == "refusal" else part.text
        if text is None:
            raise APIError(400, f"{where}[{i}].{field}: Field required (a part of type {part.type!r} carries its "
                           "text)", param=f"{where}[{i}].{field}")  # fmt: skip
        texts.append(text)
    return join_text_parts(texts)
