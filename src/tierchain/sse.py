"""Server-sent-event framing shared by the layers.

The one SSE rule every layer relies on lives here:

- :func:`last_boundary` finds where the last whole event in a buffer ends (an
  event ends with a blank line). Line endings may be LF, CR or CRLF, and a
  chunk may end anywhere, including between the CR and the LF of one line
  ending.
- :func:`has_data`, :func:`data_values`, :func:`events` and :func:`last_event` read
  whole events: progress is a complete event carrying ``data``; comments
  (``: ping``), other fields and blank lines are not.
- :func:`comment_line` builds the line Heartbeats inserts (an error event is the
  wire format's own: :mod:`tierchain.formats`).

:class:`~tierchain.observer.Observer` applies them to one response.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable
from typing import Any

__all__ = [
    "EVENT_STREAM",
    "NDJSON_LINES",
    "comment_line",
    "data_values",
    "event_names",
    "events",
    "first_events",
    "framing",
    "has_data",
    "is_event_stream",
    "is_ndjson",
    "last_boundary",
    "last_event",
]


def is_event_stream(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """True when the response headers say ``content-type: text/event-stream``."""
    return framing(headers) == EVENT_STREAM


def is_ndjson(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """True when the response headers say newline-delimited JSON (``application/x-ndjson``)."""
    return framing(headers) == NDJSON_LINES


EVENT_STREAM = 1
""":func:`framing`: ``text/event-stream``."""
NDJSON_LINES = 2
""":func:`framing`: newline-delimited JSON (``application/x-ndjson`` and its aliases)."""

_NDJSON_TYPES = frozenset({b"application/x-ndjson", b"application/ndjson", b"application/jsonl"})


def framing(headers: Iterable[tuple[bytes, bytes]]) -> int:
    """How the body is framed, from its ``content-type``: :data:`EVENT_STREAM`,
    :data:`NDJSON_LINES`, or 0 (anything else, or none)."""
    for key, value in headers:
        if key == b"content-type" or key.lower() == b"content-type":
            kind = _FRAMINGS.get(value)
            if kind is None:
                kind = _framing_of(value)
                if len(_FRAMINGS) < 64:  # upstreams send a handful of values
                    _FRAMINGS[value] = kind
            return kind
    return 0


def _framing_of(value: bytes) -> int:
    media = value.split(b";", 1)[0].strip().lower()
    if media == b"text/event-stream":
        return EVENT_STREAM
    return NDJSON_LINES if media in _NDJSON_TYPES else 0


_FRAMINGS: dict[bytes, int] = {}


_BOUNDARY = re.compile(rb"(?:\r\n|\n|\r(?!\n))(?:\r\n|\n|\r)")
_DATA_LINE = re.compile(rb"(?:^|[\r\n])data(?::|\r|\n)")


def last_boundary(buf: bytes | bytearray, start: int = 0, *, line_start: bool = True) -> int:
    """The index just past the last event boundary (a blank line) in ``buf``; 0 if none.

    Only boundaries ending at or after ``start`` are looked for: pass the length of
    what was already searched (less three bytes, since a line ending may straddle).
    A buffer ending in a CR may end in a boundary that an LF still completes.
    ``line_start`` says that ``buf`` begins where a line begins (after an event),
    so that a line ending at its very start is a blank line too.
    """
    if buf.endswith(b"\n\n") or buf.endswith(b"\r\n\r\n"):
        return len(buf)  # the usual case: the buffer ends with an event
    end = 0
    for match in _BOUNDARY.finditer(buf, max(0, start)):
        end = match.end()
    if not end:
        if not line_start:
            return 0
    elif buf[end - 1 : end] == b"\r" and buf[end : end + 1] == b"\n":
        end += 1  # the CR of a blank line written as CRLF: keep its LF with it
    size = len(buf)
    while end < size:  # blank lines right after a boundary are boundaries too
        if buf[end : end + 2] == b"\r\n":
            end += 2
        elif buf[end : end + 1] in (b"\n", b"\r"):
            end += 1
        else:
            break
    return end


def has_data(events: bytes) -> bool:
    """True when ``events`` (whole events) hold a line whose field is ``data``."""
    return (events.startswith(b"data") and events[4:5] in (b":", b"\r", b"\n")) or bool(
        _DATA_LINE.search(events)
    )


_EOL = re.compile(rb"\r\n|\r|\n")


def data_values(events: bytes) -> list[bytes]:
    """The data value of each event in ``events`` (whole events) that carries data."""
    values: list[bytes] = []
    lines: list[bytes] = []
    for line in _EOL.split(events):
        if not line:
            if lines:
                values.append(b"\n".join(lines))
                lines = []
        elif line == b"data":
            lines.append(b"")
        elif line.startswith(b"data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(b" ") else value)
    return values


def events(
    buf: bytes, *, ignore: Collection[str] = (), unended: bool = True
) -> list[tuple[str | None, bytes]]:
    """Every event of ``buf`` that carries data, in order: its ``event`` name (None when
    it has none) and its data (several ``data`` lines joined by a newline). Events named
    in ``ignore`` are left out; with ``unended``, an event the buffer ends inside (no
    blank line after it) is counted too. The one SSE event parser of the package."""
    found: list[tuple[str | None, bytes]] = []
    name: str | None = None
    lines: list[bytes] | None = None
    for line in _EOL.split(buf):
        if not line:
            if lines is not None and name not in ignore:
                found.append((name, b"\n".join(lines)))
            name, lines = None, None
        elif line.startswith(b"event:"):
            value = line[6:]
            name = (value[1:] if value.startswith(b" ") else value).decode("utf-8", "replace")
        elif line == b"data" or line.startswith(b"data:"):
            value = line[5:]
            if lines is None:
                lines = []
            lines.append(value[1:] if value.startswith(b" ") else value)
    if unended and lines is not None and name not in ignore:
        found.append((name, b"\n".join(lines)))
    return found


def last_event(
    events_: bytes, *, skip_last: bool = False, ignore: Collection[str] = ()
) -> tuple[str | None, bytes]:
    """The ``event`` name (None when it has none) and data of the last event in
    ``events_`` (whole events) that carries data, events named in ``ignore`` aside;
    with ``skip_last``, of the one before it. ``(None, b"")`` when there is none."""
    found = events(events_, ignore=ignore, unended=False)
    want = 2 if skip_last else 1
    if len(found) < want:
        return None, b""
    return found[-want]


_EVENT_NAME = re.compile(rb"(?:^|[\r\n])event:[ ]?([^\r\n]*)")


def event_names(events: bytes) -> list[bytes]:
    """The ``event`` names in ``events`` (whole events), in order."""
    return _EVENT_NAME.findall(events)


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _one_line_json(obj: Any) -> bytes:
    # JSON escapes every control character, so no raw newline survives. One
    # shared encoder: json.dumps with options builds a new one per call.
    return _ENCODER.encode(obj).encode()


def comment_line(event: dict[str, Any]) -> bytes:
    """``: {json}\\n``: one SSE comment line carrying ``event``, no blank line.

    (Heartbeats keeps the lines it repeats for every request, with their counter.)
    """
    return b": " + _one_line_json(event) + b"\n"


def first_events(chunk: bytes, n: int) -> bytes:
    """The first ``n`` data events of a chunk of whole events (with the comment lines
    before them); the whole chunk when it holds fewer."""
    end = 0
    for _ in range(n):
        start = chunk.find(b"data:", end)
        found = chunk.find(b"\n\n", start) if start >= 0 else -1
        if found < 0:
            return chunk
        end = found + 2
    return chunk[:end]
