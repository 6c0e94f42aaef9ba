"""What tierchain writes into a stream: comment lines and error events."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from tierchain import formats
from tierchain.sse import comment_line, events, last_event


@given(st.text())
def test_a_comment_line_is_one_line_whatever_a_backend_name_contains(name):
    line = comment_line({"state": "backend_failed", "backend": name})
    assert line.startswith(b": ")
    assert line.endswith(b"\n")
    assert b"\n" not in line[:-1]
    assert b"\r" not in line
    assert json.loads(line[2:])["backend"] == name


def test_an_error_event_is_an_openai_style_error():
    raw = formats.of(None).error_bytes(formats.SSE, "boom\nline", "upstream_error", "stream_broken")
    assert raw.startswith(b"data: ")
    assert raw.endswith(b"\n\n")
    assert raw.count(b"\n") == 2
    assert json.loads(raw[6:]) == {
        "error": {"message": "boom\nline", "type": "upstream_error", "code": "stream_broken"}
    }


def test_the_one_event_parser_reads_names_joined_data_and_an_unended_event():
    buf = b"event: a\ndata: 1\ndata: 2\n\n: ping\n\ndata:3\r\n\r\nevent: b\ndata: 4"
    assert events(buf) == [("a", b"1\n2"), (None, b"3"), ("b", b"4")]
    assert events(buf, unended=False) == [("a", b"1\n2"), (None, b"3")]
    assert events(buf, ignore={"a"}) == [(None, b"3"), ("b", b"4")]
    assert last_event(buf) == (None, b"3")
    assert last_event(buf, skip_last=True) == ("a", b"1\n2")
