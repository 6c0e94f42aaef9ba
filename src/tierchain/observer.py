"""One observer per attempt: what the response has shown so far.

Exactly one ``send`` wrapper per attempt feeds an :class:`Observer`: Failover's,
or, for a layer used without Failover, that layer's own. Every other layer reads
the observer's facts instead of parsing the stream itself:

- ``status``, ``headers``, ``sse`` (the body is an event stream) and ``ndjson``
  (the body is newline-delimited JSON, as Ollama streams);
- ``wire``: the request's wire format (:mod:`tierchain.wire`), which decides
  what a complete stream is and how an error after commit is written;
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

import re
from collections.abc import Callable

from . import _json
from ._runtime import clock
from ._types import Headers, Message
from .errors import StreamError
from .sse import (
    EVENT_STREAM,
    NDJSON_LINES,
    data_values,
    framing,
    has_data,
    has_finish_reason,
    last_boundary,
    last_event,
)
from .wire import ANTHROPIC, NDJSON, OLLAMA, PLAIN, RESPONSES, SSE, error_bytes

__all__ = ["MAX_EVENT", "OPENAI", "Observer", "nothing_sent", "whole_events"]

MAX_EVENT = 2**20
"""Bytes an event may grow to without its blank line before the stream is malformed."""

OPENAI = "openai"
"""The default stream end: ``data: [DONE]``, or a ``finish_reason`` before a clean end."""

_OPENAI_END = OPENAI.encode()
_DONE = b"[DONE]"
_DONE_EVENT = b"data: [DONE]\n\n"


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
        "complete",
        "data_events",
        "ended",
        "finish_seen",
        "first_data_at",
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
        "wire",
    )

    def __init__(
        self,
        started: float | None = None,
        *,
        stream_end: str | None = OPENAI,
        max_event: int = MAX_EVENT,
        wire: str | None = None,
    ) -> None:
        self.started = clock.now() if started is None else started
        if wire == PLAIN and stream_end == OPENAI:
            stream_end = None  # plain: any clean end, unless a terminator was named
        if stream_end == OPENAI:
            self._stream_end: bytes | None = _OPENAI_END  # (the default: encoded once)
        else:
            self._stream_end = None if stream_end is None else stream_end.encode()
        self.wire = wire
        self._opening = wire in _OPENING  # opening events to tell from progress
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
            return error_bytes(self.wire, SSE, message, type, code)
        if self.ndjson:
            return error_bytes(self.wire, NDJSON, message, type, code)
        return None

    def _note(self, events: bytes) -> None:
        if not (events.startswith(b"data:") or has_data(events)):
            return  # comments, pings, other fields: not progress
        if self._opening and _no_progress(self.wire, events, self):
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
        wire = self.wire
        if self.data_events == 0:
            return
        if self.ndjson:
            if wire == OLLAMA:
                self.terminated = _done_line(self._last)
            return
        if wire in (ANTHROPIC, RESPONSES):
            self.terminated = _format_end(wire, self._previous + self._last)
            return
        end = self._stream_end
        if end is None:
            return
        last = self._last
        if end == b"openai" and (last == _DONE_EVENT or last.endswith(b"\n\n" + _DONE_EVENT)):
            self.terminated = True  # the usual end, as its own event: nothing to parse
            return
        values = data_values(last)
        if len(values) < 2:
            values = data_values(self._previous) + values
        if not values:
            return
        if end == b"openai":
            self.terminated = values[-1] == _DONE
            # A finish_reason, perhaps followed by a usage chunk, then a clean end.
            self.finish_seen = any(has_finish_reason(v) for v in values[-2:])
        else:
            self.terminated = values[-1] == end

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
            wire = self.wire
            if self.ndjson:
                self.complete = self.terminated or wire != OLLAMA
            elif wire in (ANTHROPIC, RESPONSES):
                self.complete = self.terminated
            else:
                end = self._stream_end
                self.complete = (
                    end is None or self.terminated or (end == b"openai" and self.finish_seen)
                )

    def reached_end(self) -> bool:
        """True when an event stream's last data event so far is its terminator
        (``data: [DONE]``, the configured ``stream_end``, Anthropic's ``message_stop``,
        Ollama's ``"done": true`` line) with nothing after it: the answer is whole,
        whatever then happens to the transport."""
        if self.pending.strip() or self.data_events == 0:
            return False
        if self.ndjson:
            return self.wire == OLLAMA and _done_line(self._last)
        if self.wire == ANTHROPIC and self.sse:
            return _format_end(ANTHROPIC, self._previous + self._last)
        if not self.sse or self.pending or self._stream_end is None:
            return False
        if self.ended:
            return self.terminated
        self._terminate()
        whole = self.terminated
        self.terminated = self.finish_seen = False  # judged again, once, at the end
        return whole

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


# Events that open an answer (or keep a connection busy) without carrying any of it: a
# server sends them at once, before its queue or its prefill, so they are not progress.
_OPENING = {
    ANTHROPIC: frozenset({b"message_start", b"ping", b"content_block_start"}),
    RESPONSES: frozenset(
        {
            b"response.created",
            b"response.queued",
            b"response.in_progress",
            b"response.output_item.added",
            b"response.content_part.added",
        }
    ),
}
_EVENT_NAME = re.compile(rb"(?:^|[\r\n])event:[ ]?([^\r\n]*)")


def _no_progress(wire: str | None, events: bytes, observer: Observer) -> bool:
    """True when every event in ``events`` only opens the answer (or is a ping).

    Looked for until the first progress; after it, only a lone Anthropic ``ping``.
    """
    if observer.first_data_at is not None:
        return (
            wire == ANTHROPIC
            and events.startswith(b"event: ping")
            and (events.count(b"\n\n") + events.count(b"\r\n\r\n") == 1)
        )
    opening = _OPENING.get(wire or "")
    if opening is None:
        return False
    names = _EVENT_NAME.findall(events)
    return bool(names) and len(names) == len(data_values(events)) and set(names) <= opening


_RESPONSES_ENDS = frozenset({"response.completed", "response.failed", "response.incomplete"})
_PINGS = frozenset({"ping"})


def _format_end(wire: str, events: bytes) -> bool:
    """Anthropic and Responses: does the last event (a ``[DONE]`` after it aside) end it?

    Anthropic's ``ping`` events after ``message_stop`` do not count, wherever the bytes
    were split (a ping alone is never kept as the last event; one released with others is
    passed over here)."""
    name, data = last_event(events, ignore=_PINGS if wire == ANTHROPIC else ())
    if wire == RESPONSES and data == b"[DONE]":
        name, data = last_event(events, skip_last=True)
    kind = name
    if kind is None and data:
        try:
            parsed = _json.loads(data)
        except ValueError:
            return False
        kind = parsed.get("type") if isinstance(parsed, dict) else None
    if wire == ANTHROPIC:
        return kind == "message_stop"
    return kind in _RESPONSES_ENDS


def _done_line(lines: bytes) -> bool:
    """Ollama: is the last line of ``lines`` an object with ``"done": true``?"""
    last = lines.rstrip().rsplit(b"\n", 1)[-1]
    try:
        parsed = _json.loads(last)
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get("done") is True


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
