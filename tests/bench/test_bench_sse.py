from __future__ import annotations

from bench.sse import SSEEvent, SSEParser

STREAM = (
    b": keep-alive\n\n"
    b'data: {"a": 1}\n\n'
    b"event: ping\ndata: x\n\n"
    b'data: {"text": "caf\xc3\xa9 \xf0\x9f\x98\x80"}\n\n'
    b"data: [DONE]\n\n"
)
EXPECTED = [
    SSEEvent('{"a": 1}'),
    SSEEvent("x", "ping"),
    SSEEvent('{"text": "café 😀"}'),
    SSEEvent("[DONE]"),
]


def feed_all(chunks: list[bytes]) -> list[SSEEvent]:
    parser = SSEParser()
    events = [event for chunk in chunks for event in parser.feed(chunk)]
    return events + parser.close()


def test_whole_stream_in_one_chunk() -> None:
    assert feed_all([STREAM]) == EXPECTED


def test_events_split_at_every_byte() -> None:
    # Also splits the UTF-8 characters in the middle: bytes wait until their line is whole.
    assert feed_all([STREAM[i : i + 1] for i in range(len(STREAM))]) == EXPECTED


def test_events_split_at_awkward_places() -> None:
    for cut in range(1, len(STREAM)):
        assert feed_all([STREAM[:cut], STREAM[cut:]]) == EXPECTED, cut


def test_crlf_and_cr_line_endings() -> None:
    crlf = STREAM.replace(b"\n", b"\r\n")
    assert feed_all([crlf]) == EXPECTED
    assert feed_all([crlf[i : i + 1] for i in range(len(crlf))]) == EXPECTED  # CR and LF in separate chunks
    assert feed_all([STREAM.replace(b"\n", b"\r")]) == EXPECTED


def test_multiple_events_per_chunk_and_comments_between() -> None:
    parser = SSEParser()
    events = parser.feed(b"data: 1\n\n:comment\ndata: 2\n\ndata: 3\n")
    assert [e.data for e in events] == ["1", "2"]
    assert [e.data for e in parser.feed(b"\n")] == ["3"]


def test_multiline_data_without_space_and_blank_lines() -> None:
    parser = SSEParser()
    assert parser.feed(b"\n\ndata:a\ndata: b\nid: 7\nretry: 10\n\n") == [SSEEvent("a\nb")]


def test_unterminated_event_is_dropped_at_close() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: partial") == []
    assert parser.close() == []
