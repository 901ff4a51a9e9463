"""One response as it is generated: output items (messages with an output_text part, function calls) built from
text deltas, each change told as a streaming event of the Responses API with its sequence_number, and the
response object at every stage. The non-streaming answer is the same builder fed the whole text once, so both
agree by construction.

Items open lazily: a message when its first text arrives, a function call when the tool-call parser names it, a
reasoning item (with a reasoning parser: the model's thought, before its answer) when the thought's first text does;
only one item is open at a time, and opening the next closes it. Every stream ends with exactly one terminal
event: response.completed, response.incomplete (cut by max_output_tokens or the context) or response.failed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from engine.outputs import FinishReason
from engine.reasoning_parser import ReasoningSplitter
from web.tool_calls import ArgumentsPiece, ToolCallHeader, ToolCallParser
from web.tool_calls.parser import CallSyntax, ParserEvent

Event = dict[str, Any]
ABORTED = "the response was cut short: the server is shutting down, or the client stopped reading"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    def __init__(self, response_id: str, settings: dict[str, Any], syntax: CallSyntax | None) -> None:
        """settings: the request's fields that the response object echoes (model, instructions, tools, ...)."""
        self.id = response_id
        self.created_at = int(time.time())
        self.settings = settings
        self.parser = ToolCallParser(syntax) if syntax is not None else None
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written (the last of output)
        self._text: list[str] = []  # the open message's text, in pieces
        self._sequence_number = 0
        self.status = "in_progress"
        self.error: dict[str, Any] | None = None
        self.incomplete_details: dict[str, Any] | None = None
        self.completed_at: int | None = None
        self.usage: dict[str, Any] | None = None
        self.splitter: ReasoningSplitter | None = None

    def read_reasoning(self, new_splitter: Callable[[], ReasoningSplitter] | None) -> None:
        """Split the thought from the answer: a reasoning item, then the message (or calls)."""
        self.splitter = new_splitter() if new_splitter is not None else None

    @property
    def num_reasoning_tokens(self) -> int:
        return self.splitter.num_reasoning_tokens if self.splitter is not None else 0

    # -- events -----------------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return event

    def start(self) -> list[Event]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]  # fmt: skip

    def failure_event(self, message: str) -> Event:
        """The terminal event of a stream whose writing failed (a bug of this server): OpenAI's error event."""
        return self._event("error", code="server_error", message=message, param=None)

    def feed(self, text: str, token_ids: list[int] | None = None) -> list[Event]:
        """The next piece of generated text (and its tokens): the events it makes (often one output_text delta)."""
        events: list[Event] = []
        if self.splitter is not None:
            reasoning, text = self.splitter.feed(text, token_ids)
            events += self._reasoning(reasoning) if reasoning else []
        return events + self._answer(text)

    def _answer(self, text: str) -> list[Event]:
        if self.parser is None:
            return self._content(text) if text else []
        events: list[Event] = []
        for parsed in self.parser.feed(text):
            events += self._parsed(parsed)
        return events

    def finish(self, reason: FinishReason | None, error: str | None, usage: dict[str, Any],
               error_code: str | None = None) -> list[Event]:  # fmt: skip
        """The output ended: flush the parser, close the open item, the terminal event (with the whole response)."""
        events: list[Event] = []
        if self.splitter is not None:  # whitespace it held: the thought's, or the answer's
            reasoning, text = self.splitter.finish()
            events += self._reasoning(reasoning) if reasoning else []
            events += self._answer(text)
        if self.parser is not None:
            for parsed in self.parser.finish():
                events += self._parsed(parsed)
        is_whole = reason in (FinishReason.STOP, FinishReason.TOOL_CALLS)  # the engine says STOP; be safe
        if all(item["type"] == "reasoning" for item in self.output) and is_whole:  # an empty answer is a message
            events += self._open_message()
        events += self._close("completed" if is_whole else "incomplete")
        self.usage = usage
        if is_whole:
            self.status, self.completed_at = "completed", int(time.time())
        elif reason is FinishReason.LENGTH:
            self.status, self.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
        else:
            message = error if reason is FinishReason.ERROR and error else ABORTED
            self.status, self.error = "failed", {"code": error_code or "server_error", "message": message}
        return [*events, self._event(f"response.{self.status}", response=self.response())]

    def _parsed(self, parsed: ParserEvent) -> list[Event]:
        if isinstance(parsed, str):
            return self._content(parsed)
        if isinstance(parsed, ToolCallHeader):
            return self._open_call(parsed)
        assert isinstance(parsed, ArgumentsPiece)
        return self._arguments(parsed.text)

    def _content(self, text: str) -> list[Event]:
        events = [] if self._open is not None and self._open["type"] == "message" else self._open_message()
        self._text.append(text)
        return [*events, self._event("response.output_text.delta", item_id=self._open["id"],  # type: ignore[index]
                                     output_index=len(self.output) - 1, content_index=0, delta=text, logprobs=[])]  # fmt: skip

    def _reasoning(self, text: str) -> list[Event]:
        events = [] if self._open is not None and self._open["type"] == "reasoning" else self._open_reasoning()
        self._text.append(text)
        return [*events, self._event("response.reasoning_text.delta", item_id=self._open["id"],  # type: ignore[index]
                                     output_index=len(self.output) - 1, content_index=0, delta=text)]  # fmt: skip

    def _open_reasoning(self) -> list[Event]:
        events = self._close("completed")
        item = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
        self._open, self._text = item, []
        self.output.append(item)
        return [*events, self._event("response.output_item.added", output_index=len(self.output) - 1,
                                     item=dict(item, content=[]))]  # fmt: skip

    def _open_message(self) -> list[Event]:
        events = self._close("completed")
        item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        self._open, self._text = item, []
        self.output.append(item)
        index = len(self.output) - 1
        return [*events, self._event("response.output_item.added", output_index=index, item=dict(item, content=[])),
                self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                            part=_text_part(""))]  # fmt: skip

    def _open_call(self, header: ToolCallHeader) -> list[Event]:
        events = self._close("completed")
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": header.id,
                "name": header.name, "arguments": ""}  # fmt: skip
        self._open = item
        self.output.append(item)
        return [*events, self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]

    def _arguments(self, piece: str) -> list[Event]:
        item = self._open
        assert item is not None and item["type"] == "function_call", "argument pieces follow their call's header"
        item["arguments"] += piece
        return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=len(self.output) - 1, delta=piece)]  # fmt: skip

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.output) - 1
        item["status"] = status
        events: list[Event] = []
        if item["type"] == "message":
            text = "".join(self._text)
            self._text = []
            item["content"] = [_text_part(text)]
            events += [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text, logprobs=[]),
                       self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=_text_part(text))]  # fmt: skip
        elif item["type"] == "reasoning":
            text = "".join(self._text)
            self._text = []
            item["content"] = [{"type": "reasoning_text", "text": text}]
            events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=text))  # fmt: skip
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                      arguments=item["arguments"]))  # fmt: skip
        return [*events, self._event("response.output_item.done", output_index=index, item=item)]

    # -- the response object ------------------------------------------------------------------------------------
    def response(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": False,
            "completed_at": self.completed_at,
            "error": self.error,
            "incomplete_details": self.incomplete_details,
            **self.settings,
            "output": [_snapshot(item) for item in self.output],
            "usage": self.usage,
        }

    def output_text(self) -> str:
        return "".join(part["text"] for item in self.output if item["type"] == "message" for part in item["content"])


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _snapshot(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": list(item["content"])} if item["type"] in ("message", "reasoning") else dict(item)


def usage_object(num_input_tokens: int, num_output_tokens: int, num_cached_tokens: int,
                 num_reasoning_tokens: int = 0) -> dict[str, Any]:  # fmt: skip
    return {
        "input_tokens": num_input_tokens,
        "input_tokens_details": {"cached_tokens": num_cached_tokens, "cache_write_tokens": 0},
        "output_tokens": num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": num_reasoning_tokens},
        "total_tokens": num_input_tokens + num_output_tokens,
    }
