"""Tool calls out of generated text, streamed: content, then calls, each as a header (name) and argument pieces.

One parser per response, fed the text as it is generated. Text that might start a call is held back until it
is known not to be one; a call's arguments are passed on as the model writes them (the raw JSON text of the
"arguments" value), so the pieces of a stream join into exactly what the whole text yields at once. Parsing
the whole text is the same parser fed once, which is how the streamed and the non-streamed answers agree.

An output cut short (max_tokens) leaves no markup in the content: what was held back as a possible call (an
opener, a call without arguments yet, a closer, a separator) is dropped. A call is passed on once its name is
known and its arguments have begun; a stream cannot take it back then, so a call cut in its arguments is kept
with the arguments as far as they were written, streamed or not.

A family (web/tool_calls/formats.py) says where calls start and end:
- Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the output, any number.
- Llama 3 JSON: the whole output is `{"name": ..., "parameters": {...}}` (after an optional <|python_tag|>),
  calls separated by ";".
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

# `{"name": "<name>", "arguments": ` at the start of a call's body (the order a constrained call has).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass(slots=True)
class ToolCallHeader:
    index: int
    id: str
    name: str


@dataclass(slots=True)
class ArgumentsPiece:
    index: int
    text: str


ParserEvent = str | ToolCallHeader | ArgumentsPiece  # a str is content


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class CallSyntax:
    """Where a family's calls are in the text."""

    start: str  # what opens a call ("" = a call opens at the very start of the output only)
    end: str  # what closes a call after its JSON object ("" = the object's closing brace)
    prefixes: tuple[str, ...] = ()  # optional text before the first call (Llama 3's <|python_tag|>)
    separator: str = ""  # between calls when start is "" (Llama 3: ";")


@dataclass
class _Call:
    index: int
    body_start: int  # where the JSON object begins in the text
    header: ToolCallHeader | None = None
    args_start: int = -1
    args_emitted: int = 0  # characters of the arguments value passed on
    args_done: bool = False
    scan: int = -1  # next character of the arguments value to scan
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    last_solid: int = -1  # the last non-whitespace character of the value so far
    object_end: _ObjectEnd | None = None  # the search for the "}" that closes the call's object, once begun


@dataclass
class ToolCallParser:
    syntax: CallSyntax
    text: str = ""
    pos: int = 0  # text before pos has been passed on (as content or as part of a call)
    calls: list[ParsedCall] = field(default_factory=list)
    _call: _Call | None = None
    _is_plain: bool = False  # Llama 3: the output did not open with a call, so it is all content
    _calls_end: int = 0  # where the last call ended (0 before the first): a call may open after it

    def feed(self, delta: str) -> list[ParserEvent]:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> list[ParserEvent]:
        """The output ended: flush what was held back. What the final pass still holds is markup cut short (or
        whitespace after a call), except an output of whitespace only, which is content."""
        events = self._advance(final=True)
        rest = self.text[self.pos :]
        if rest.isspace() and not self.calls:
            events.append(rest)
        self.pos = len(self.text)
        return [e for e in events if not isinstance(e, str) or e]

    # ---- the state machine ---------------------------------------------------------------------------
    def _advance(self, final: bool) -> list[ParserEvent]:
        events: list[ParserEvent] = []
        while True:
            if self._call is None:
                opened = self._open_call(events, final)
                if not opened:
                    return [e for e in events if not isinstance(e, str) or e]
            call = self._call
            assert call is not None
            if not self._step_call(call, events, final):
                return [e for e in events if not isinstance(e, str) or e]

    def _open_call(self, events: list[ParserEvent], final: bool) -> bool:
        syntax, text = self.syntax, self.text
        if self._is_plain:
            events.append(text[self.pos :])
            self.pos = len(text)
            return False
        if not syntax.start:  # Llama 3: calls from the start of the output on, or none at all
            stripped = text[self.pos :].lstrip()
            if self.calls:
                if stripped.startswith(syntax.separator) and syntax.separator:
                    stripped = stripped[len(syntax.separator) :].lstrip()
                elif syntax.separator.startswith(stripped):
                    return False  # empty, or maybe a separator: wait (held to the end, it is dropped)
            else:
                for prefix in syntax.prefixes:
                    if stripped.startswith(prefix):
                        stripped = stripped[len(prefix) :].lstrip()
                    elif prefix.startswith(stripped):
                        return False  # maybe the prefix: wait (held to the end, it is dropped)
            if not stripped:
                return False
            if stripped[0] != "{":
                self._is_plain = True
                return self._open_call(events, final)
            self._call = _Call(len(self.calls), len(text) - len(stripped))
            return True
        found = text.find(syntax.start, self.pos)
        if found < 0:
            held = _partial_suffix(text, syntax.start, self.pos)
            if final and text[self._calls_end : len(text) - held].strip():
                held = 0  # a cut opener after content is content; where a call may open, it is dropped
            end = len(text) - held
            if self.calls:  # whitespace after a call is not content (held until something else follows it)
                end = self.pos + len(text[self.pos : end].rstrip())
            events.append(text[self.pos : end])
            self.pos = end
            return False
        if not (self.calls and text[self.pos : found].isspace()):
            events.append(text[self.pos : found])
        self.pos = found  # the opener is held until the call has a name (else it is content after all)
        self._call = _Call(len(self.calls), found + len(syntax.start))
        return True

    def _step_call(self, call: _Call, events: list[ParserEvent], final: bool) -> bool:
        """Progress in one call; True when the call ended and the text after it may be parsed."""
        text = self.text
        if call.header is None:
            match = _HEAD.match(text, call.body_start)
            if match is None:
                return self._parse_whole_call(call, events, final)
            if match.end() == len(text):  # a call is passed on with its arguments' first piece, never without
                return self._drop_cut_call() if final else False
            call.header = ToolCallHeader(call.index, f"call_{uuid.uuid4().hex[:24]}", json.loads(f'"{match.group(1)}"'))
            self.calls.append(ParsedCall(call.header.id, call.header.name))
            events.append(call.header)
            call.args_start = call.scan = match.end()
        if not call.args_done:
            events += self._scan_arguments(call, final)
            if not call.args_done:
                return False
        return self._close_call(call, final)

    def _scan_arguments(self, call: _Call, final: bool) -> list[ParserEvent]:
        text = self.text
        if call.args_emitted == 0 and call.last_solid < call.args_start:  # no leading whitespace in arguments
            while call.args_start < len(text) and text[call.args_start].isspace():
                call.args_start += 1
            call.scan = max(call.scan, call.args_start)
        i = call.scan
        while i < len(text):
            c = text[i]
            if call.in_string:
                if call.escaped:
                    call.escaped = False
                elif c == "\\":
                    call.escaped = True
                elif c == '"':
                    call.in_string = False
            elif c == '"':
                call.in_string = True
            elif c in "{[":
                call.depth += 1
            elif c in "}]" or (c == "," and call.depth == 0):
                if call.depth == 0:  # the enclosing object goes on or ends: the value ended before c
                    call.args_done = True
                    break
                call.depth -= 1
                if call.depth == 0:
                    call.last_solid = i
                    call.args_done = True
                    i += 1
                    break
            if not c.isspace():
                call.last_solid = i
            i += 1
        call.scan = i
        if final:
            call.args_done = True
        end = call.last_solid + 1
        piece = text[call.args_start + call.args_emitted : end] if end > call.args_start else ""
        if not piece:
            return []
        call.args_emitted += len(piece)
        self.calls[-1].arguments += piece
        return [ArgumentsPiece(call.index, piece)]

    def _close_call(self, call: _Call, final: bool) -> bool:
        """After the arguments: skip to the end of the object and the call's closer; False to wait for more."""
        text, syntax = self.text, self.syntax
        if call.object_end is None:
            call.object_end = _ObjectEnd(call.scan)
        close = call.object_end.find(text)
        if close < 0:
            if final:
                self.pos = len(text)
                self._call = None
            return False
        end = close + 1
        if syntax.end:
            rest = text[end:]
            stripped = rest.lstrip()
            if stripped.startswith(syntax.end):
                end = len(text) - len(stripped) + len(syntax.end)
            elif syntax.end.startswith(stripped):
                if not final:
                    return False
                end = len(text)  # a closer cut short
        self.pos = self._calls_end = end
        self._call = None
        return True

    def _parse_whole_call(self, call: _Call, events: list[ParserEvent], final: bool) -> bool:
        """A body that does not open with "name": wait for the whole object, then take it as a call (keys in any
        order) or, if it is not one, as content."""
        text = self.text
        if call.object_end is None:
            stripped_start = len(text) - len(text[call.body_start :].lstrip())
            if stripped_start < len(text) and text[stripped_start] != "{":
                return self._not_a_call(call, events)
            if stripped_start >= len(text):
                return self._drop_cut_call() if final else False
            call.object_end = _ObjectEnd(stripped_start + 1)
        stripped_start = call.object_end.start - 1
        close = call.object_end.find(text)
        if close < 0:
            if not final:
                return False
            if self.syntax.start or self.calls or _may_open_call(text[stripped_start:]):
                return self._drop_cut_call()
            return self._not_a_call(call, events)  # Llama 3: a plain answer in JSON, cut short
        try:  # RecursionError: JSON nested deeper than Python parses, which a model writes when asked to
            obj = json.loads(text[stripped_start : close + 1])
            arguments = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
            args_text = json.dumps(arguments, ensure_ascii=False)
        except (ValueError, RecursionError):
            return self._not_a_call(call, events)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or arguments is None:
            return self._not_a_call(call, events)
        call.header = ToolCallHeader(call.index, f"call_{uuid.uuid4().hex[:24]}", obj["name"])
        self.calls.append(ParsedCall(call.header.id, call.header.name, args_text))
        events += [call.header, ArgumentsPiece(call.index, args_text)]
        call.args_done, call.scan = True, close
        return self._close_call(call, final)

    def _drop_cut_call(self) -> bool:
        """The output ended in a call that has no arguments yet: it is neither a call nor content."""
        self._call = None
        self.pos = len(self.text)
        return False

    def _not_a_call(self, call: _Call, events: list[ParserEvent]) -> bool:
        """What looked like a call is content: pass the opener on and look for the next one after it."""
        self._call = None
        if not self.syntax.start:
            self._is_plain = True  # Llama 3: the rest of the output is content
            return True
        events.append(self.text[self.pos : call.body_start])
        self.pos = call.body_start
        return True


@dataclass(slots=True)
class _ObjectEnd:
    """The "}" that closes an object whose inside starts at `start` (depth 1 there), searched for as the text grows:
    each character is read once, however many deltas the object takes (a search from the start at every delta made
    a long object quadratic)."""

    start: int
    scan: int = -1  # the next character to read
    depth: int = 1
    in_string: bool = False
    escaped: bool = False
    end: int = -1  # the closing "}", once found

    def find(self, text: str) -> int:
        """Its index in text (which only grows between calls), or -1 while it has not come."""
        if self.end >= 0:
            return self.end
        for i in range(max(self.scan, self.start), len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i
                    return i
        self.scan = len(text)
        return -1


def _may_open_call(text: str) -> bool:
    """Whether text (an object cut short) opens as a call does, with "name" first (as constrained calls do)."""
    head = re.sub(r"\s+", "", text[:64])[: len('{"name"')]
    return '{"name"'.startswith(head)


def _partial_suffix(text: str, marker: str, start: int) -> int:
    """The length of the longest end of text[start:] that begins marker (held back: it may become it)."""
    for n in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
