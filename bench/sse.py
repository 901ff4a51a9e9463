"""Incremental Server-Sent Events parser: bytes in (any split), complete events out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SSEEvent:
    data: str
    event: str = "message"


class SSEParser:
    """Follows the WHATWG event-stream rules that matter for OpenAI-style streams.

    Lines end in LF, CRLF or CR; `data:` lines of one event are joined with LF; lines starting with `:`
    are comments (keep-alives); a blank line dispatches the event. Bytes are buffered until a line is
    whole, so a UTF-8 character split across network chunks decodes correctly.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._event = ""
        self._pending_cr = False  # the last chunk ended in CR: a leading LF in the next one belongs to it

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self._pending_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._pending_cr = chunk.endswith(b"\r")
        self._buffer += chunk
        events: list[SSEEvent] = []
        while True:
            cut = _line_end(self._buffer)
            if cut is None:
                break
            end, skip = cut
            line = self._buffer[:end].decode("utf-8", errors="replace")
            self._buffer = self._buffer[end + skip :]
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[SSEEvent]:
        """End of stream: a final unterminated line is processed; an undispatched event is dropped (per spec)."""
        events = self.feed(b"\n") if self._buffer else []
        self._data, self._event = [], ""
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if line == "":
            if not self._data:
                self._event = ""
                return None
            event = SSEEvent("\n".join(self._data), self._event or "message")
            self._data, self._event = [], ""
            return event
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        return None


def _line_end(buffer: bytes) -> tuple[int, int] | None:
    """(index of the terminator, its length), or None while the line is incomplete."""
    lf = buffer.find(b"\n")
    cr = buffer.find(b"\r")
    if cr == -1 and lf == -1:
        return None
    if cr == -1 or (lf != -1 and lf < cr):
        return lf, 1
    if cr + 1 < len(buffer):
        return cr, 2 if buffer[cr + 1 : cr + 2] == b"\n" else 1
    # A CR at the very end: a line end either way; feed() drops the LF if it arrives next.
    return cr, 1
