"""One observer per attempt: what the response has shown so far.

Exactly one ``send`` wrapper per attempt feeds an :class:`Observer`: Failover's,
or, for a layer used without Failover, that layer's own. Every other layer reads
the observer's facts instead of parsing the stream itself:

- ``status``, ``headers``, ``sse`` (the body is an event stream) and ``ndjson``
  (the body is newline-delimited JSON, as Ollama streams);
- ``wire``: the request's wire format, and ``format`` its object (one module of
  :mod:`tierchain.formats` each), which decides what a complete stream is, what
  is progress and how an error after commit is written;
- ``first_data_at``: when the first *complete* event carrying ``data`` arrived
  (for NDJSON, the first complete line; for any other body, its first bytes).
  A partial line, a comment or the headers are not progress;
- ``last_event_at``: when the latest complete data event (or body bytes) arrived;
- ``terminated``: the last data event was the stream's terminator, judged
  once, at the end, by the wire format: ``data: [DONE]`` for OpenAI shapes (a
  ``finish_reason`` in one of the last two data events also completes one);
  ``event: message_stop`` for Anthropic; ``response.completed`` (or the
  upstream's own ``response.failed`` / ``response.incomplete``) for Responses;
  a line with ``"done": true`` for Ollama's NDJSON;
- ``pending``: the bytes of an event not yet complete, which never reach the
  caller until its blank line arrives;
- ``ended``: the final body message passed.

:meth:`Observer.body` returns the bytes that may go to the caller now: whole
events only. An event that grows past ``max_event`` bytes without a boundary
makes the stream malformed (:class:`~tierchain.errors.StreamError`,
``malformed_stream``). An NDJSON body is released in whole lines the same way.

The one rule this needs from the host: nothing stacked between tierchain's
layers may rewrite response bytes (compress, re-chunk into other events, add
lines). tierchain's layers only ever add whole lines at event boundaries.
"""

from __future__ import annotations

from collections.abc import Callable

from . import formats
from ._runtime import clock
from ._types import Headers, Message
from .errors import StreamError
from .sse import (
    EVENT_STREAM,
    NDJSON_LINES,
    data_values,
    framing,
    has_data,
    last_boundary,
)

__all__ = ["MAX_EVENT", "OPENAI", "Observer", "nothing_sent", "whole_events"]

MAX_EVENT = 2**20
"""Bytes an event may grow to without its blank line before the stream is malformed."""

OPENAI = "openai"
"""The default stream end: ``data: [DONE]``, or a ``finish_reason`` before a clean end."""


class Observer:
    """Facts about one attempt's response, fed by the one ``send`` wrapper that owns it.

    ``wire`` is the request's wire format (None: OpenAI's rules). For the
    ``openai`` and ``plain`` formats, ``stream_end`` says when an event stream is
    complete: :data:`OPENAI`, another string (a data event whose value is exactly
    that string), or None (any clean end; ``plain`` with the default). See the
    module docstring for the facts it keeps.
    """

    __slots__ = (
        "_last",
        "_opening",
        "_previous",
        "_searched",
        "_stream_end",
        "_wire",
        "complete",
        "data_events",
        "ended",
        "finish_seen",
        "first_data_at",
        "format",
        "framed",
        "headers",
        "last_event_at",
        "max_event",
        "ndjson",
        "on_first_data",
        "opened",
        "pending",
        "pending_cr",
        "sse",
        "started",
        "status",
        "terminated",
    )

    def __init__(
        self,
        started: float | None = None,
        stream_end: str | None = OPENAI,
        wire: str | None = None,
        *,
        max_event: int = MAX_EVENT,
    ) -> None:
        self.started = clock.now() if started is None else started
        self.wire = wire  # (sets ``format``, the wire format's object, and ``_opening``)
        self._stream_end = self.format.stream_end(stream_end)
        self.max_event = max_event
        self.status: int | None = None
        self.headers: Headers = []
        self.sse = False
        self.ndjson = False
        self.framed = False
        """True when the body is a stream of whole units (events or lines) judged at its end."""
        self.opened = False
        """True once an event that opens the answer but is not progress passed (an
        Anthropic ``message_start`` or ``ping``, a Responses ``response.created``)."""
        self.first_data_at: float | None = None
        self.last_event_at: float | None = None
        self.data_events = 0
        self.terminated = False
        self.finish_seen = False
        # The partial event (or line) held back, grown in place: an event fed a byte
        # at a time costs linear time, never a copy of everything held per byte.
        self.pending = bytearray()
        self.pending_cr = False
        self.ended = False
        self.complete = False
        """True once the response ended whole: an event stream reached its end."""
        self._searched = 0
        self._last = self._previous = b""
        self.on_first_data: list[Callable[[], None]] = []
        """Called once, when the first data event (or first body bytes) arrives."""

    @property
    def wire(self) -> str | None:
        """The request's wire format (None: OpenAI's rules)."""
        return self._wire

    @wire.setter
    def wire(self, wire: str | None) -> None:
        # A layer alone may learn the format after it made its observer (from the path).
        self._wire = wire
        # The format's object (tierchain.formats): what is complete, what is progress, how
        # an error is written. Picked once here; asked, never branched on.
        self.format = formats.of(wire)
        self._opening = bool(self.format.opening)  # opening events to tell from progress

    def start(self, status: int, headers: Headers) -> None:
        """Note the response's status and headers."""
        self.status = status
        self.headers = headers
        kind = framing(headers)
        self.sse = kind == EVENT_STREAM
        self.ndjson = kind == NDJSON_LINES
        self.framed = self.sse or self.ndjson

    def body(self, chunk: bytes) -> bytes:
        """Note a body chunk; return what may go to the caller now (whole events only).

        For a body that is not an event stream, ``chunk`` itself.
        """
        if (
            self.sse
            and chunk[:5] == b"data:"
            and chunk[-1] == 10  # "\n\n" (indexes: cheaper than a slice or endswith)
            and chunk[-2] == 10
            and not self.pending
            and not self.pending_cr
        ):
            # The usual case: whole events starting with data, nothing held. (Failover's
            # Responder.send has this case inline, a frame less a chunk: change both.)
            self.last_event_at = clock.now()
            self.data_events += 1
            self._previous, self._last = self._last, chunk
            if self.first_data_at is None:
                self.first_data_at = self.last_event_at
                self._first()
            return chunk
        if not self.sse:
            if self.ndjson:
                return self._lines(chunk)
            if chunk:
                now = self.last_event_at = clock.now()
                self._previous, self._last = self._last, chunk
                if self.first_data_at is None:
                    self.first_data_at = now
                    self._first()
            return chunk
        if not chunk:
            return b""
        if self.pending_cr:
            # The last byte released was a CR: an LF now completes that line ending.
            self.pending_cr = False
            if chunk[:1] == b"\n" and not self.pending:
                return b"\n" + self.body(chunk[1:]) if len(chunk) > 1 else b"\n"
        buf: bytes | bytearray
        if self.pending:
            buf = self.pending
            buf += chunk  # (in place)
            end = last_boundary(buf, self._searched, line_start=False)
        else:
            buf = chunk
            end = last_boundary(buf)
        if end == 0:
            if len(buf) > self.max_event:
                raise StreamError(
                    f"an event grew past {self.max_event} bytes without ending",
                    reason="malformed_stream",
                )
            self.pending = buf if isinstance(buf, bytearray) else bytearray(buf)
            self._searched = max(0, len(buf) - 3)
            return b""
        if end < len(buf):
            events = bytes(buf[:end])
            self.pending = bytearray(buf[end:])
            self._searched = 0
            if len(self.pending) > self.max_event:
                raise StreamError(
                    f"an event grew past {self.max_event} bytes without ending",
                    reason="malformed_stream",
                )
        else:
            events = bytes(buf)
            self.pending = bytearray()
            self._searched = 0
        # A released CR may yet be followed by the LF of its own line ending.
        self.pending_cr = end == len(buf) and events[-1:] == b"\r"
        self._note(events)
        return events

    def _lines(self, chunk: bytes) -> bytes:
        """NDJSON: release whole lines only; a complete line is progress."""
        if not chunk:
            return b""
        at = chunk.rfind(b"\n")
        if at < 0:
            pending = self.pending
            pending += chunk  # (in place: a line fed a byte at a time costs linear time)
            if len(pending) > self.max_event:
                raise StreamError(
                    f"a line grew past {self.max_event} bytes without ending",
                    reason="malformed_stream",
                )
            return b""
        if self.pending:
            lines = bytes(self.pending + chunk[: at + 1])
        else:
            lines = chunk if at == len(chunk) - 1 else chunk[: at + 1]
        self.pending = bytearray(chunk[at + 1 :])
        if lines.strip():
            now = self.last_event_at = clock.now()
            self.data_events += 1
            self._previous, self._last = self._last, lines
            if self.first_data_at is None:
                self.first_data_at = now
                self._first()
        return lines

    def error_bytes(self, message: str, type: str, code: str | None = None) -> bytes | None:
        """An error to end this response with after commit, in its wire format's own
        shape (None: the body is not a stream, so the connection must be aborted)."""
        if self.sse:
            return self.format.error_bytes(formats.SSE, message, type, code)
        if self.ndjson:
            return self.format.error_bytes(formats.NDJSON, message, type, code)
        return None

    def _note(self, events: bytes) -> None:
        if not (events.startswith(b"data:") or has_data(events)):
            return  # comments, pings, other fields: not progress
        if self._opening and self.format.no_progress(events, self.first_data_at is not None):
            self.opened = True  # kept for the first event that carries the answer
            return
        now = self.last_event_at = clock.now()
        self.data_events += 1
        # Kept, not searched: the terminator is looked for once, at the end.
        self._previous, self._last = self._last, events
        if self.first_data_at is None:
            self.first_data_at = now
            self._first()

    def _terminate(self) -> None:
        """At the end: did the last data event carry the stream's terminator?"""
        if self.data_events == 0:
            return
        if self.ndjson:
            self.terminated = self.format.line_ends(self._last)
            return
        self.terminated, self.finish_seen = self.format.judge(
            self._previous, self._last, self._stream_end
        )

    def _first(self) -> None:
        for callback in self.on_first_data:
            try:
                callback()
            except Exception:  # a watcher must never break the stream
                pass

    def end(self) -> None:
        """Note the final body message (and judge, once, whether the response is whole)."""
        if not self.ended:
            self.ended = True
            if not self.sse and not self.ndjson:
                self.complete = True
                return
            self._terminate()
            if self.first_data_at is None:
                return
            if self.ndjson:
                self.complete = self.terminated or not self.format.needs_done_line
            else:
                self.complete = self.format.whole(
                    self.terminated, self.finish_seen, self._stream_end
                )

    def reached_end(self) -> bool:
        """True when an event stream's last data event so far is its terminator
        (``data: [DONE]``, the configured ``stream_end``, Anthropic's ``message_stop``,
        Ollama's ``"done": true`` line) with nothing after it: the answer is whole,
        whatever then happens to the transport."""
        if self.pending.strip() or self.data_events == 0:
            return False
        if self.ndjson:
            return self.format.line_ends(self._last)
        if not self.sse or self.pending:
            return False
        if self.ended:
            return self.terminated
        return self.format.judge(self._previous, self._last, self._stream_end)[0]

    def tail_values(self) -> list[bytes]:
        """The JSON values of the last two data chunks seen (where a stream's usage is),
        or the last two body chunks of an answer that is not a stream."""
        if self.sse:
            return data_values(self._previous) + data_values(self._last)
        if self.ndjson:
            return (self._previous + self._last).splitlines()
        return [self._previous + self._last]

    def drop_pending(self) -> bytes:
        """Forget the partial event held back (a failed attempt's); returns it."""
        pending, self.pending = self.pending, bytearray()
        self._searched = 0
        return bytes(pending)

    def verdict(self) -> str:
        """The outcome word for a response that passed (``ok`` or why it is not)."""
        status = self.status
        if status is None:
            return "no_response"
        if status >= 400:
            return f"http_{status}"
        if self.complete:
            return "ok"
        if not self.ended:
            return "stream_broken"
        return "no_data" if self.first_data_at is None else "truncated"


def whole_events(observer: Observer, message: Message) -> Message | None:
    """For a layer used alone: the body message to pass on (whole events only), or None.

    An event that never ends is passed on as it is (judging it is Failover's
    job); a partial event at the very end is dropped, never shown half.
    """
    chunk: bytes = message.get("body", b"")
    more = bool(message.get("more_body", False))
    try:
        out = observer.body(chunk)
    except StreamError:
        out = observer.drop_pending() + chunk
        observer.sse = observer.ndjson = observer.framed = False  # stop splitting this stream
    if not more:
        observer.end()
        observer.drop_pending()
        return {"type": "http.response.body", "body": out, "more_body": False}
    if not out:
        return None
    return {"type": "http.response.body", "body": out, "more_body": True}


async def nothing_sent() -> None:
    """What a ``send`` wrapper returns when it passes nothing on (yet)."""
    return None
