"""Tool-call families: how a chat template shows tools to the model, how the model writes calls, and the
grammar that makes it write them (for tool_choice "required" or a named function, and for the generic mode).

Chosen from the chat template's text (detect_tool_format):
- Hermes (Qwen 2.5, Hermes, many fine-tunes): the template knows `<tool_call>`; calls are
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
- Llama 3 JSON (Llama 3.1 / 3.2): the template knows `<|python_tag|>` or the `ipython` role; a call is the
  whole output, `{"name": ..., "parameters": {...}}`, several separated by "; ".
- Generic (templates with no tool format, such as the default SmolLM2's): the tools are described in a system
  message, calls are written Hermes-style, and every output is constrained by a grammar: with tool_choice
  "auto" it is either plain text (that holds no `<tool_call>`) or calls.
With tool_choice "auto" and a JSON answer format, any family's output is that JSON or calls (a grammar).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from web.tool_calls.parser import CallSyntax

# The compact JSON the grammar writes (as json.dumps does), inside %json{...} of a Lark grammar.
_JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A function declared without parameters takes none (as in OpenAI's API), not any object.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters or _NO_PARAMETERS}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    syntax: CallSyntax
    arguments_key: str  # "arguments" or "parameters"
    call_open: str  # what a constrained call is written between
    call_close: str
    call_separator: str  # between constrained parallel calls
    is_in_template: bool  # the chat template renders tools itself (tools=); else a system message does

    @property
    def markers(self) -> tuple[str, ...]:
        return tuple(m for m in (self.syntax.start, self.syntax.end) if m)

    def call_grammar(
        self, tools: Sequence[FunctionTool], is_parallel: bool, marker_tokens: Mapping[str, int] | None = None
    ) -> str:
        """A Lark grammar (llguidance's dialect): one call of one of `tools`, or several if is_parallel.

        marker_tokens: markers that are single added tokens of the tokenizer (Qwen's <tool_call>), by id:
        llguidance reads an added token as a token, not as its text, so the grammar must name it so."""
        markers = marker_tokens or {}
        parts = [_lark_literal(self.call_open, markers), "%json" + json.dumps(self._calls_schema(tools)),
                 _lark_literal(self.call_close, markers)]  # fmt: skip
        call = " ".join(p for p in parts if p)
        repeat = f" ({json.dumps(self.call_separator)} call)*" if is_parallel else ""
        return f"start: call{repeat}\ncall: {call}\n"

    def auto_grammar(self, tools: Sequence[FunctionTool], is_parallel: bool) -> str:
        """Generic mode, tool_choice "auto": plain text that holds no call opener, or calls. The parser reads a call
        wherever an opener is: one in the text would be a call no grammar wrote (of any name, any arguments)."""
        calls = self.call_grammar(tools, is_parallel).replace("start:", "calls:", 1)
        opener = self.call_open.strip()
        text = f"TEXT: /(?s:.+)/ & ~/(?s:.*{_regex_literal(opener)}.*)/"
        return f"start: TEXT | calls\n{text}\n{calls}"

    def answer_or_calls_grammar(
        self, tools: Sequence[FunctionTool], is_parallel: bool, answer_schema: dict[str, Any],
        marker_tokens: Mapping[str, int] | None = None,
    ) -> str:
        """tool_choice "auto" with an answer format (response_format, text.format): a JSON answer of that schema,
        or calls (as OpenAI's models answer in the format or call a tool)."""
        calls = self.call_grammar(tools, is_parallel, marker_tokens).replace("start:", "calls:", 1)
        answer = {"x-guidance": _JSON_FORMAT, **answer_schema}
        return f"start: answer | calls\nanswer: %json{json.dumps(answer)}\n{calls}"

    def _calls_schema(self, tools: Sequence[FunctionTool]) -> dict[str, Any]:
        # A tool's "$ref"s point into its own parameters ("#/$defs/Unit", as pydantic writes them), which sit one
        # level down here: such parameters go under the root's "$defs", their refs rewritten to match.
        defs: dict[str, Any] = {}
        options = []
        for i, t in enumerate(tools):
            arguments = t.parameters or _NO_PARAMETERS
            if _has_local_ref(arguments):
                key = f"sluice_tool_{i}"
                defs[key] = _rebase_refs(arguments, f"#/$defs/{key}")
                arguments = {"$ref": f"#/$defs/{key}"}
            options.append({
                "type": "object",
                "properties": {"name": {"const": t.name}, self.arguments_key: arguments},
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            })  # fmt: skip
        schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
        if defs:
            schema = {**schema, "$defs": defs}
        return {**schema, "x-guidance": _JSON_FORMAT}

    def system_prompt(self, tools: Sequence[FunctionTool]) -> str:
        """Generic mode: what the model is told about the tools."""
        listed = "\n".join(json.dumps(t.as_openai()["function"], ensure_ascii=False) for t in tools)
        return (
            "You can call functions. These are their signatures (JSON schema):\n<tools>\n"
            f"{listed}\n</tools>\nTo call one, answer with\n"
            f'{self.call_open}{{"name": <function name>, "{self.arguments_key}": <arguments object>}}{self.call_close}'
        )

    def history_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Generic mode: earlier calls and tool results as text a template without tools can render."""
        out: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            if message["role"] == "assistant" and message.get("tool_calls"):
                calls = "".join(
                    self.call_open
                    + json.dumps({"name": c["function"]["name"], self.arguments_key: c["function"]["arguments"]},
                                 ensure_ascii=False)  # fmt: skip
                    + self.call_close
                    for c in message["tool_calls"]
                )
                out.append({"role": "assistant", "content": (message.get("content") or "") + calls})
            elif message["role"] == "tool":
                response = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
                if i and messages[i - 1]["role"] == "tool":  # the results of parallel calls: one user turn (as
                    out[-1]["content"] += "\n" + response  # Qwen's template has them; Gemma's refuses two in a row)
                else:
                    out.append({"role": "user", "content": response})
            else:
                out.append({k: v for k, v in message.items() if k in ("role", "content")})
        return out


HERMES = ToolFormat("hermes", CallSyntax("<tool_call>", "</tool_call>"), "arguments",
                    "<tool_call>\n", "\n</tool_call>", "\n", is_in_template=True)  # fmt: skip
LLAMA3_JSON = ToolFormat("llama3_json", CallSyntax("", "", ("<|python_tag|>",), ";"), "parameters",
                         "", "", "; ", is_in_template=True)  # fmt: skip
GENERIC = ToolFormat("generic", CallSyntax("<tool_call>", "</tool_call>"), "arguments",
                     "<tool_call>", "</tool_call>", "\n", is_in_template=False)  # fmt: skip


def detect_tool_format(chat_template: str | None) -> ToolFormat:
    template = chat_template or ""
    if "tools" not in template:
        return GENERIC
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3_JSON
    return GENERIC


def _is_local_ref(key: str, value: Any) -> bool:
    """A "$ref" by JSON pointer within the same schema ("#" or "#/..."); anchors and other documents are not."""
    return key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/"))


# Keywords whose values are instances (data), not schemas: a "$ref" key inside them is the client's data.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _has_local_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return any(_is_local_ref(k, v) or (k not in _DATA_KEYWORDS and _has_local_ref(v)) for k, v in node.items())
    if isinstance(node, list):
        return any(_has_local_ref(v) for v in node)
    return False


def _rebase_refs(node: Any, base: str) -> Any:
    """node with each local "$ref" ("#/$defs/Unit") made relative to base ("#/$defs/sluice_tool_0/$defs/Unit")."""
    if isinstance(node, dict):
        return {k: base + v[1:] if _is_local_ref(k, v) else v if k in _DATA_KEYWORDS else _rebase_refs(v, base)
                for k, v in node.items()}  # fmt: skip
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    return node


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in text)


def _lark_literal(text: str, tokens: Mapping[str, int]) -> str:
    """text as Lark terminals: JSON string literals, and <[id]> for the pieces that are the given tokens."""
    parts: list[str] = []
    i = 0
    while i < len(text):
        token = next((t for t in tokens if text.startswith(t, i)), None)
        if token is not None:
            parts.append(f"<[{tokens[token]}]>")
            i += len(token)
            continue
        j = i + 1
        while j < len(text) and not any(text.startswith(t, j) for t in tokens):
            j += 1
        parts.append(json.dumps(text[i:j]))
        i = j
    return " ".join(parts)
