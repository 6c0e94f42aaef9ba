"""Server-sent-event framing shared by the layers.

Three small mechanics, each fed the response body chunk by chunk:

- :class:`FirstChunk` says when the first event that carries ``data:`` has
  started. Comments (``: ping``), other fields and blank lines are not progress.
- :class:`EventTail` says whether the bytes sent so far end at an event
  boundary, which is the only place anything may be inserted into a stream.
  It looks at the last three bytes only, so it costs the same for any chunk.
- :func:`comment_line` and :func:`error_event` build what we insert.

Line endings may be LF, CR or CRLF, and a chunk may end anywhere, including
between the CR and the LF of one line ending.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

__all__ = [
    "EventTail",
    "FirstChunk",
    "comment_line",
    "error_event",
    "error_json",
    "is_event_stream",
]

_TERMINATORS = b"\r\n"


def is_event_stream(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """True when the response headers say ``content-type: text/event-stream``."""
    for key, value in headers:
        if key.lower() == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"text/event-stream"
    return False


class FirstChunk:
    """Detects the start of the first SSE event that carries ``data``.

    ``feed(chunk)`` returns True once a line whose field name is ``data`` has
    begun (``data:`` or a bare ``data`` line). It keeps at most five bytes of
    the current line between calls.
    """

    __slots__ = ("_line", "found")

    def __init__(self) -> None:
        self._line = b""
        self.found = False

    def feed(self, chunk: bytes) -> bool:
        """Look at the next chunk of the body; True once a data line has started."""
        if self.found:
            return True
        if not self._line and chunk.startswith(b"data:"):
            self.found = True  # the usual first event: a data line at a line start
            return True
        start, size = 0, len(chunk)
        while True:
            ends = [i for i in (chunk.find(b"\n", start), chunk.find(b"\r", start)) if i >= 0]
            end = min(ends) if ends else -1
            head = self._line + chunk[start : (end if end >= 0 else size)][:5]
            if head.startswith(b"data:") or (end >= 0 and head == b"data"):
                self.found = True
                return True
            if end < 0:
                self._line = head[:5]
                return False
            self._line = b""
            start = end + 1
            if start >= size:
                return False


class EventTail:
    """Tracks whether the bytes sent so far end exactly at an event boundary.

    ``at_boundary`` is True at the start of the stream and after a blank line.
    ``pending_cr`` is True when the stream ends in a CR that an LF may still
    complete: nothing may be inserted there, or the LF would become a blank
    line of its own.
    """

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        # A virtual line ending stands for "stream start": a boundary.
        self._tail = b"\n\n"

    def feed(self, chunk: bytes) -> None:
        """Note that ``chunk`` was sent."""
        if len(chunk) >= 3:
            # Keep the (immutable) chunk itself: its last three bytes are read
            # only when asked, so a chunk costs no copy.
            self._tail = chunk
        elif chunk:
            self._tail = self._tail[-3:] + chunk

    @property
    def pending_cr(self) -> bool:
        """True when the last byte sent is a CR."""
        return self._tail.endswith(b"\r")

    @property
    def at_boundary(self) -> bool:
        """True when the last bytes sent end an event (a blank line)."""
        t = self._tail
        last = t[-1:]
        if last == b"\n":
            if t[-2:-1] == b"\r":  # CRLF: look before it
                return t[-3:-2] in (b"\r", b"\n")
            return t[-2:-1] == b"\n"
        if last == b"\r":
            return t[-2:-1] in (b"\r", b"\n")
        return False

    @property
    def at_line_start(self) -> bool:
        """True when the last byte sent ends a line."""
        return self._tail[-1:] in (b"\r", b"\n")

    def closing_bytes(self) -> bytes:
        """What to send so that the stream stands at an event boundary."""
        if self.at_boundary:
            return b""
        return b"\n" if self.at_line_start else b"\n\n"


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _one_line_json(obj: Any) -> bytes:
    # JSON escapes every control character, so no raw newline survives. One
    # shared encoder: json.dumps with options builds a new one per call.
    return _ENCODER.encode(obj).encode()


def comment_line(event: dict[str, Any]) -> bytes:
    """``: {json}\\n``: one SSE comment line carrying ``event``, no blank line."""
    return b": " + _one_line_json(event) + b"\n"


def error_json(message: str, type: str, code: str | None = None, **extra: Any) -> dict[str, Any]:
    """The OpenAI-compatible error object ``{"error": {...}}``."""
    error: dict[str, Any] = {"message": message, "type": type, "code": code}
    error.update(extra)
    return {"error": error}


def error_event(message: str, type: str, code: str | None = None, **extra: Any) -> bytes:
    """``data: {"error": {...}}`` and a blank line: an error OpenAI clients raise."""
    return b"data: " + _one_line_json(error_json(message, type, code, **extra)) + b"\n\n"
