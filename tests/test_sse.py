"""The SSE framing mechanics, against a reference parser and hypothesis."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from tierchain.sse import EventTail, FirstChunk, comment_line, error_event


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for p in points:
        pieces.append(data[last:p])
        last = p
    pieces.append(data[last:])
    return pieces


def _ref_boundary(data: bytes) -> bool:
    """Reference: the stream ends right after a blank line (or is empty)."""
    if not data:
        return True
    text = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return text.endswith(b"\n\n") or text == b"\n"


line_endings = st.sampled_from([b"\n", b"\r\n", b"\r"])
lines = st.sampled_from([b": ping", b'data: {"a": 1}', b"id: 7", b"event: x", b"", b"data"])


@st.composite
def streams(draw):
    out = b""
    for _ in range(draw(st.integers(0, 12))):
        out += draw(lines) + draw(line_endings)
    return out


@given(streams(), st.lists(st.integers(0, 10_000), max_size=6))
def test_the_event_tail_agrees_with_a_reference_parser_however_the_stream_is_cut(data, cuts):
    tail = EventTail()
    for piece in _split(data, cuts):
        tail.feed(piece)
    # A CR at the very end may still be joined by an LF; the reference treats it as a line end.
    assert tail.at_boundary == _ref_boundary(data)
    assert tail.pending_cr == data.endswith(b"\r")


@given(streams(), st.lists(st.integers(0, 10_000), max_size=6))
def test_the_first_chunk_is_the_first_data_line_however_the_stream_is_cut(data, cuts):
    detector = FirstChunk()
    found = False
    for piece in _split(data, cuts):
        found = detector.feed(piece)
    text = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    complete_lines = text.split(b"\n")[:-1]
    partial = text.split(b"\n")[-1]
    expected = any(ln.startswith(b"data:") or ln == b"data" for ln in complete_lines) or (
        partial.startswith(b"data:")
    )
    assert found == expected


def test_pings_and_comments_are_not_the_first_chunk():
    detector = FirstChunk()
    assert not detector.feed(b': ping\n\n: {"state":"x"}\nid: 1\n')
    assert not detector.feed(b"da")
    assert detector.feed(b"ta: {}")


@given(st.text())
def test_a_comment_line_is_one_line_whatever_a_backend_name_contains(name):
    line = comment_line({"state": "backend_failed", "backend": name})
    assert line.startswith(b": ")
    assert line.endswith(b"\n")
    assert b"\n" not in line[:-1]
    assert b"\r" not in line
    assert json.loads(line[2:])["backend"] == name


def test_an_error_event_is_an_openai_style_error():
    raw = error_event("boom\nline", "upstream_error", "stream_broken")
    assert raw.startswith(b"data: ")
    assert raw.endswith(b"\n\n")
    assert raw.count(b"\n") == 2
    assert json.loads(raw[6:]) == {
        "error": {"message": "boom\nline", "type": "upstream_error", "code": "stream_broken"}
    }


def test_closing_bytes_bring_a_stream_to_a_boundary():
    for sent, closing in [
        (b"", b""),
        (b"data: x\n\n", b""),
        (b"data: x\n", b"\n"),
        (b"data: x", b"\n\n"),
    ]:
        tail = EventTail()
        tail.feed(sent)
        assert tail.closing_bytes() == closing
