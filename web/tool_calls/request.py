"""One chat request's tools -> what the engine gets (messages, template arguments, a grammar) and how its
output is read (the call syntax, or None when calls are not parsed)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequest
from engine.structured_outputs import StructuredOutputs
from web.tool_calls.formats import FunctionTool, ToolFormat
from web.tool_calls.parser import CallSyntax


@dataclass(slots=True)
class ToolPlan:
    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    structured_outputs: StructuredOutputs | None = None
    syntax: CallSyntax | None = None  # None: the output is content only
    tools: Sequence[FunctionTool] = ()  # those the grammar holds
    answer: tuple[str, dict[str, Any]] | None = None  # the answer format the grammar holds: (its param, schema)

    @contextmanager
    def errors_named(self) -> Iterator[None]:
        """A tools grammar that does not compile (the input processor's InvalidRequest naming "tools") is told in
        the client's terms: the tool, or the answer format, whose schema llguidance cannot hold. Looked for only
        then: a request whose tools compile pays for one compile."""
        try:
            yield
        except InvalidRequest as error:
            if error.param != "tools":
                raise
            raise _culprit(self.tools, self.answer) or error from None


def plan_tools(
    fmt: ToolFormat,
    messages: list[dict[str, Any]],
    tools: Sequence[FunctionTool],
    choice: str,
    function_name: str | None,
    is_parallel: bool,
    marker_tokens: Mapping[str, int] | None = None,
    answer: StructuredOutputs | None = None,
) -> ToolPlan:
    """choice: "none", "auto", "required" or "function" (then function_name names it); marker_tokens: the
    format's markers that are single added tokens (see ToolFormat.call_grammar); answer: the format a reply
    that is not a call must have (response_format, text.format; a JSON schema or any JSON object). A plan's
    structured_outputs, when set, replaces the request's own."""
    if not fmt.is_in_template:
        messages = fmt.history_messages(messages)
    if not tools or choice == "none":
        return ToolPlan(messages)
    if choice == "function":
        tools = [t for t in tools if t.name == function_name]
        is_parallel = False
    if fmt.is_in_template:
        plan = ToolPlan(messages, {"tools": [t.as_openai() for t in tools]}, syntax=fmt.syntax)
    else:
        plan = ToolPlan(_with_system_prompt(messages, fmt.system_prompt(tools)), syntax=fmt.syntax)
    plan.tools = tools
    if choice in ("required", "function"):  # the output is calls: an answer format has nothing to shape
        grammar = fmt.call_grammar(tools, is_parallel, marker_tokens)
    elif answer is not None:
        plan.answer = (answer.error_param(), _answer_schema(answer))
        grammar = fmt.answer_or_calls_grammar(tools, is_parallel, plan.answer[1], marker_tokens)
    elif not fmt.is_in_template:
        grammar = fmt.auto_grammar(tools, is_parallel)
    else:
        return plan  # auto with a template that knows tools: the model chooses, the parser reads
    plan.structured_outputs = StructuredOutputs(grammar=grammar, param="tools")
    return plan


def _answer_schema(answer: StructuredOutputs) -> dict[str, Any]:
    if answer.json_object:
        return {"type": "object"}
    try:
        schema = json.loads(answer.json) if isinstance(answer.json, str) else answer.json
    except ValueError as error:
        raise InvalidRequest(f"{answer.error_param()} is not JSON: {error}", answer.error_param()) from None
    if not isinstance(schema, dict):
        raise InvalidRequest("with tools, the answer format must be a JSON schema or json_object", answer.error_param())
    return schema


def _culprit(tools: Sequence[FunctionTool], answer: tuple[str, dict[str, Any]] | None) -> InvalidRequest | None:
    """The first tool, or else the answer format, whose schema llguidance cannot hold (the combined grammar's
    error points into Sluice's wrapping of the schemas), as the client's error."""
    for tool in tools:
        if tool.parameters and (error := _schema_error(tool.parameters)) is not None:
            return InvalidRequest(f"the parameters of tool {tool.name!r} are not a usable JSON schema: {error}", "tools")
    if answer is not None and (error := _schema_error(answer[1])) is not None:
        return InvalidRequest(f"{answer[0]} cannot be compiled: {error}", answer[0])
    return None


def _schema_error(schema: dict[str, Any]) -> str | None:
    """Why llguidance cannot hold this JSON schema, in its own words, or None."""
    from llguidance import LLMatcher

    try:
        error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema), None)
    except ValueError as exc:  # raised by grammar_from_json_schema for some malformed schemas
        error = str(exc)
    return error.strip()[:300] or None


def _with_system_prompt(messages: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{prompt}".lstrip()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
