"""One chat request's tools -> what the engine gets (messages, template arguments, a grammar) and how its
output is read (the call syntax, or None when calls are not parsed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


def plan_tools(
    fmt: ToolFormat,
    messages: list[dict[str, Any]],
    tools: Sequence[FunctionTool],
    choice: str,
    function_name: str | None,
    is_parallel: bool,
    marker_tokens: Mapping[str, int] | None = None,
) -> ToolPlan:
    """choice: "none", "auto", "required" or "function" (then function_name names it); marker_tokens: the
    format's markers that are single added tokens (see ToolFormat.call_grammar)."""
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
    if choice in ("required", "function") or not fmt.is_in_template:
        _check_parameters(tools)
    if choice in ("required", "function"):
        grammar = fmt.call_grammar(tools, is_parallel, marker_tokens)
    elif not fmt.is_in_template:
        grammar = fmt.auto_grammar(tools, is_parallel)
    else:
        return plan  # auto with a template that knows tools: the model chooses, the parser reads
    plan.structured_outputs = StructuredOutputs(grammar=grammar, param="tools")
    return plan


def _check_parameters(tools: Sequence[FunctionTool]) -> None:
    """A tool whose parameters are no JSON schema a grammar can hold is named, in the client's own terms (the
    combined grammar's error would point into Sluice's wrapping of the schemas)."""
    from llguidance import LLMatcher

    for tool in tools:
        if not tool.parameters:
            continue
        try:
            error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(tool.parameters), None)
        except ValueError as exc:  # raised by grammar_from_json_schema for some malformed schemas
            error = str(exc)
        if error:
            raise InvalidRequest(f"the parameters of tool {tool.name!r} are not a usable JSON schema: "
                                 f"{error.strip()[:300]}", "tools")  # fmt: skip


def _with_system_prompt(messages: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{prompt}".lstrip()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
