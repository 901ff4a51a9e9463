"""An SSE event's data is one line for every line reader: str.splitlines() (httpx's iter_lines) also ends lines at
U+0085, U+2028 and U+2029, which JSON leaves raw in strings, and a model's text may hold them (a tiny random model's
did, and one cluster test read half an event)."""

from __future__ import annotations

import orjson

from web.responses_api.stream import encode_events
from web.sse import sse_event

TEXT = "a\u2028b\u2029c\x85d\u00e9\u4e2d\U0001f600\n\r\t"


def test_an_event_with_line_separators_in_its_text_is_one_line_and_decodes_the_same() -> None:
    event = sse_event({"choices": [{"text": TEXT}]})
    lines = event.decode().splitlines()
    assert lines == [lines[0], ""] and lines[0].startswith("data: ")
    assert orjson.loads(lines[0][len("data: ") :]) == {"choices": [{"text": TEXT}]}


def test_a_responses_event_is_one_data_line_too() -> None:
    lines = encode_events([{"type": "response.output_text.delta", "delta": TEXT}]).decode().splitlines()
    assert lines[0] == "event: response.output_text.delta" and lines[2:] == [""]
    assert orjson.loads(lines[1][len("data: ") :])["delta"] == TEXT
