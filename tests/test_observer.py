"""The observer against a plain reference SSE parser, however a stream is cut."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierchain.errors import StreamError
from tierchain.observer import Observer

_EOL = re.compile(rb"\r\n|\r|\n")


def reference(data: bytes) -> tuple[list[int], list[list[bytes]]]:
    """A plain reading of the SSE spec: where each event ends, and each event's lines."""
    boundaries: list[int] = []
    events: list[list[bytes]] = []
    fields: list[bytes] = []
    line_start = 0
    for match in _EOL.finditer(data):
        line = data[line_start : match.start()]
        if line:
            fields.append(line)
        else:
            boundaries.append(match.end())
            events.append(fields)
            fields = []
        line_start = match.end()
    return boundaries, events


def _is_data(line: bytes) -> bool:
    return line == b"data" or line.startswith(b"data:")


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for p in points:
        pieces.append(data[last:p])
        last = p
    pieces.append(data[last:])
    return pieces


line_endings = st.sampled_from([b"\n", b"\r\n", b"\r"])
lines = st.sampled_from(
    [
        b": ping",
        b'data: {"a": 1}',
        b"id: 7",
        b"event: x",
        b"",
        b"data",
        b"data: [DONE]",
        b"retry: 5",
    ]
)


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    out = b""
    for _ in range(draw(st.integers(0, 14))):
        out += draw(lines) + draw(line_endings)
    if draw(st.booleans()):
        out += draw(lines)  # a stream may end in the middle of a line
    return out


@settings(max_examples=400)
@given(streams(), st.lists(st.integers(0, 10_000), max_size=8))
def test_the_observer_passes_whole_events_only_however_the_stream_is_cut(data, cuts):
    observer = Observer()
    observer.start(200, [(b"content-type", b"text/event-stream")])
    released = b""
    for piece in _split(data, cuts):
        out = observer.body(piece)
        released += out
        if out:
            # Every release ends where an event ends (or on the CR of a blank line whose
            # LF is still to come).
            boundaries, _ = reference(data[: len(released)])
            assert boundaries
            assert boundaries[-1] == len(released)
    boundaries, events = reference(data)
    last = boundaries[-1] if boundaries else 0
    assert released == data[:last]
    assert observer.pending == data[last:]
    complete = events  # every event the reference closed with its blank line
    expect_data = any(_is_data(line) for event in complete for line in event)
    assert (observer.first_data_at is not None) == expect_data
    observer.end()
    data_events = [e for e in complete if any(_is_data(line) for line in e)]
    done = bool(data_events) and [ln for ln in data_events[-1] if _is_data(ln)] in (
        [b"data: [DONE]"],
        [b"data:[DONE]"],
    )
    assert observer.terminated == done


def test_a_partial_line_a_comment_or_headers_are_not_progress():
    observer = Observer()
    observer.start(200, [(b"content-type", b"text/event-stream")])
    assert observer.body(b": ping\n\n") == b": ping\n\n"
    assert observer.first_data_at is None
    assert observer.body(b'data: {"id":"chatcmpl-1","object":"cha') == b""
    assert observer.first_data_at is None
    assert observer.body(b'"}\n\n') == b'data: {"id":"chatcmpl-1","object":"cha"}\n\n'
    assert observer.first_data_at is not None


def test_an_event_that_never_ends_is_a_malformed_stream():
    observer = Observer(max_event=1024)
    observer.start(200, [(b"content-type", b"text/event-stream")])
    observer.body(b"data: " + b"x" * 1000)
    with pytest.raises(StreamError) as caught:
        observer.body(b"x" * 100)
    assert caught.value.reason == "malformed_stream"


@pytest.mark.parametrize(
    ("stream", "verdict"),
    [
        (b'data: {"choices":[{"finish_reason":null}]}\n\ndata: [DONE]\n\n', "ok"),
        (b'data: {"choices":[{"finish_reason":"stop"}]}\n\n', "ok"),
        (b'data: {"choices":[{"finish_reason":null}]}\n\n', "truncated"),
        (b": ping\n\n", "no_data"),
        (b"\x00\x01garbage without an end", "no_data"),
    ],
)
def test_an_openai_stream_is_complete_only_with_its_terminator(stream, verdict):
    observer = Observer()
    observer.start(200, [(b"content-type", b"text/event-stream")])
    observer.body(stream)
    observer.end()
    assert observer.verdict() == verdict


def test_another_shape_names_its_own_terminator_or_none():
    for end, stream, verdict in [
        ("[END]", b"data: a\n\ndata: [END]\n\n", "ok"),
        ("[END]", b"data: a\n\ndata: [DONE]\n\n", "truncated"),
        (None, b"data: a\n\n", "ok"),
    ]:
        observer = Observer(stream_end=end)
        observer.start(200, [(b"content-type", b"text/event-stream")])
        observer.body(stream)
        observer.end()
        assert observer.verdict() == verdict, (end, stream)


# -- Responder.send's copy of the usual case (docs/internals.md, copies kept for speed) --


async def test_responders_copy_of_the_usual_chunk_leaves_what_observer_body_leaves():
    """A committed stream's usual chunks go through Responder.send's inline copy of
    Observer.body's first case: the observer must end up as Observer.body leaves it."""
    import httpx

    from tierchain import Backend, Failover
    from tierchain.request import TierRequest

    chunks = [
        b'data: {"n":1}\n\n',
        b'data: {"n":2}\n\n',
        b'data: {"n":3}\n\ndata: {"n":4}\n\n',
        b'data: {"n":5}\n\n',
    ]
    seen: dict[str, object] = {}

    async def upstream(scope, receive, send):
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        req = TierRequest.find(scope)
        assert req is not None
        assert req.observer is not None
        observer = req.observer
        seen.update(
            data_events=observer.data_events,
            last=observer._last,
            previous=observer._previous,
            pending=bytes(observer.pending),
        )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    routes = {"echo": [Backend(name="a", url="http://127.0.0.1:1")]}
    app = Failover(upstream, routes=routes)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        answer = await c.post("/v1/chat/completions", json={"model": "echo", "stream": True})
    assert answer.content == b"".join(chunks) + b"data: [DONE]\n\n"

    original = Observer()
    original.start(200, [(b"content-type", b"text/event-stream")])
    for chunk in chunks:
        assert original.body(chunk) == chunk
    assert seen == {
        "data_events": original.data_events,
        "last": original._last,
        "previous": original._previous,
        "pending": bytes(original.pending),
    }
    assert seen["last"] == chunks[-1]
    assert seen["previous"] == chunks[-2]
