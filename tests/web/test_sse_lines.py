"""An SSE event's data is one line for every line reader: str.splitlines() (httpx's iter_lines) also ends lines at
U+0085, U+2028 and U+2029, which JSON leaves raw in strings, and a model's text may hold them (a tiny random model's
did, and one cluster test read half an event). And a stream's last events leave in one write."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import orjson

from engine.outputs import FinishReason
from web.responses_api.stream import encode_events
from web.sse import DONE, sse_event, stream_events

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


class _Request:
    num_choices = 1
    on_read_timeout = None


class _Outputs:
    """Two token outputs, the second one finishing: what the engine's output stream gives a one-choice request."""

    def __init__(self) -> None:
        self.request = _Request()

    async def __aenter__(self) -> _Outputs:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        for text, finished in (("a", False), ("b", True)):
            yield SimpleNamespace(text=text, finished=finished, finish_reason=FinishReason.LENGTH if finished else None,
                                  index=0, error=None, stop_reason=None)  # fmt: skip


class _Format:
    include_usage = continuous_usage = False

    def opening_chunks(self, num_choices: int) -> list[dict]:
        return [{"open": num_choices}]

    def delta_chunks(self, output: SimpleNamespace) -> list[dict]:
        return [{"text": output.text}]

    def finish_chunk(self, reason: FinishReason, index: int, stop_reason: str | int | None) -> dict:
        return {"finish": reason.value}


class _Timer:
    ended = True

    def observe(self, output: object) -> None:
        pass


def test_the_last_token_its_finish_chunk_and_done_leave_in_one_write() -> None:
    async def writes() -> list[bytes]:
        return [w async for w in stream_events(_Outputs(), _Format(), _Timer())]  # type: ignore[arg-type]

    opening, first, last = asyncio.run(writes())
    assert opening == sse_event({"open": 1}) and first == sse_event({"text": "a"})
    assert last == sse_event({"text": "b"}) + sse_event({"finish": "length"}) + DONE
