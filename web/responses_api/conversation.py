"""A conversation as canonical items, and those items as the chat template's messages.

Canonical items are plain JSON-ready dicts, what the store keeps and previous_response_id prepends:
  {"type": "message", "role": "user" | "assistant" | "system" | "developer", "content": text}
  {"type": "function_call", "call_id", "name", "arguments"}   (arguments: the JSON text the model wrote)
  {"type": "function_call_output", "call_id", "output"}       (output: text)
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequest
from web.schemas import ChatMessage

Item = dict[str, Any]


def message(role: str, content: str) -> Item:
    return {"type": "message", "role": role, "content": content}


def function_call(call_id: str, name: str, arguments: str) -> Item:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}


def function_call_output(call_id: str, output: str) -> Item:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def with_ids(response_id: str, items: list[Item]) -> list[Item]:
    """The items a response is stored with, each with an id: its own (an output item's, one the client gave),
    else one made from the response's id and its place. A later response's listing shows the same ids."""
    base = response_id.removeprefix("resp_")
    return [item if "id" in item else {**item, "id": f"{_ID_PREFIXES.get(item['type'], 'item')}_{base}_{i}"}
            for i, item in enumerate(items)]  # fmt: skip


def listed_input_items(items: list[Item]) -> list[dict[str, Any]]:
    """A stored response's input items (with_ids') as GET /v1/responses/{id}/input_items shows them: OpenAI's
    item objects."""
    listed = []
    for item in items:
        kind = item["type"]
        shown: dict[str, Any] = {**item, "status": "completed"}
        if kind == "message":
            part = "output_text" if item["role"] == "assistant" else "input_text"
            shown["content"] = [{"type": part, "text": item["content"]}]
        listed.append(shown)
    return listed


def output_items_as_input(output: list[dict[str, Any]]) -> list[Item]:
    """A response's output items (messages with output_text parts, function calls) as canonical items."""
    items = []
    for item in output:
        if item["type"] == "message":
            text = "".join(part.get("text", "") for part in item["content"])
            items.append({**message("assistant", text), "id": item["id"]})
        elif item["type"] == "function_call":
            items.append({**function_call(item["call_id"], item["name"], item["arguments"]), "id": item["id"]})
    return items


def chat_messages(instructions: str | None, items: list[Item]) -> list[dict[str, Any]]:
    """The messages a chat template renders. Calls right after an assistant message (or after other calls)
    join that assistant turn; a call's output becomes a tool message naming its function. Instructions lead
    as the system prompt (joined with a leading system message: many templates take only one, at the top)."""
    turns: list[dict[str, Any]] = []  # ChatMessage fields, one dict per message
    names_by_call: dict[str, str] = {}
    for item in items:
        kind = item["type"]
        if kind == "message":
            turns.append({"role": item["role"], "content": item["content"]})
        elif kind == "function_call":
            names_by_call[item["call_id"]] = item["name"]
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            if not turns or turns[-1]["role"] != "assistant":
                turns.append({"role": "assistant", "content": None})
            turns[-1].setdefault("tool_calls", []).append(call)
        else:
            name = names_by_call.get(item["call_id"])
            if name is None:  # as OpenAI answers: an output must follow its call (in the input or the stored chain)
                raise InvalidRequest(f"no function call found for the function_call_output with call_id "
                                     f"{item['call_id']!r}", "input")  # fmt: skip
            turns.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"], "name": name})
    answered = {item["call_id"] for item in items if item["type"] == "function_call_output"}
    for call_id in names_by_call:
        if call_id not in answered:  # as OpenAI answers: each call needs its output before the model goes on
            raise InvalidRequest(f"no tool output found for function call {call_id!r}", "input")
    rendered = [ChatMessage.model_validate(turn).as_template_dict() for turn in turns]
    if instructions:
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": f"{instructions}\n\n{rendered[0]['content']}"}
        else:
            rendered.insert(0, {"role": "system", "content": instructions})
    return rendered
