"""One observer per attempt: what the response has shown so far.

Exactly one ``send`` wrapper per attempt feeds an :class:`Observer`: Failover's,
or, for a layer used without Failover, that layer's own. Every other layer reads
the observer's facts instead of parsing the stream itself:

- ``status``, ``headers`` and ``sse`` (the body is an event stream);
- ``first_data_at``: when the first *complete* event carrying ``data`` arrived
  (for any other body, its first bytes). A partial line, a comment or the
  headers are not progress;
- ``last_event_at``: when the latest complete data event (or body bytes) arrived;
- ``terminated``: the last data event was the stream's terminator (``data:
  [DONE]`` for OpenAI shapes; a ``finish_reason`` in one of the last two data
  events also completes one), judged once, at the end;
- ``pending``: the bytes of an event not yet complete, which never reach the
  caller until its blank line arrives;
- ``ended``: the final body message passed.

:meth:`Observer.body` returns the bytes that may go to the caller now: whole
events only. An event that grows past ``max_event`` bytes without a boundary
makes the stream malformed (:class:`~tierchain.errors.StreamError`,
``malformed_stream``).

The one rule this needs from the host: nothing stacked between tierchain's
layers may rewrite response bytes (compress, re-chunk into other events, add
lines). tierchain's layers only ever add whole lines at event boundaries.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ._types import Headers, Message
from .errors import StreamError
from .sse import data_values, has_data, has_finish_reason, is_event_stream, last_boundary

__all__ = ["MAX_EVENT", "OPENAI", "Observer", "nothing_sent", "whole_events"]

MAX_EVENT = 2**20
"""Bytes an event may grow to without its blank line before the stream is malformed."""

OPENAI = "openai"
"""The default stream end: ``data: [DONE]``, or a ``finish_reason`` before a clean end."""

_DONE = b"[DONE]"
_DONE_EVENT = b"data: [DONE]\n\n"
_now = time.monotonic


class Observer:
    """Facts about one attempt's response, fed by the one ``send`` wrapper that owns it.

    ``stream_end`` says when an event stream is complete: :data:`OPENAI`, another
    string (a data event whose value is exactly that string), or None (any clean
    end). See the module docstring for the facts it keeps.
    """

    __slots__ = (
        "_last",
        "_previous",
        "_searched",
        "_stream_end",
        "complete",
        "data_events",
        "ended",
        "finish_seen",
        "first_data_at",
        "headers",
        "last_event_at",
        "max_event",
        "on_first_data",
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
        *,
        stream_end: str | None = OPENAI,
        max_event: int = MAX_EVENT,
    ) -> None:
        self.started = time.monotonic() if started is None else started
        self._stream_end = None if stream_end is None else stream_end.encode()
        self.max_event = max_event
        self.status: int | None = None
        self.headers: Headers = []
        self.sse = False
        self.first_data_at: float | None = None
        self.last_event_at: float | None = None
        self.data_events = 0
        self.terminated = False
        self.finish_seen = False
        self.pending = b""
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
        self.sse = is_event_stream(headers)

    def body(self, chunk: bytes) -> bytes:
        """Note a body chunk; return what may go to the caller now (whole events only).

        For a body that is not an event stream, ``chunk`` itself.
        """
        if (
            self.sse
            and chunk.endswith(b"\n\n")
            and chunk.startswith(b"data:")
            and not self.pending
            and not self.pending_cr
        ):
            # The usual case: whole events starting with data, nothing held.
            self.last_event_at = _now()
            self.data_events += 1
            self._previous, self._last = self._last, chunk
            if self.first_data_at is None:
                self.first_data_at = self.last_event_at
                self._first()
            return chunk
        if not self.sse:
            if chunk:
                now = self.last_event_at = time.monotonic()
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
        if self.pending:
            buf = self.pending + chunk
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
            self.pending = buf
            self._searched = max(0, len(buf) - 3)
            return b""
        if end < len(buf):
            events = buf[:end]
            self.pending = buf[end:]
            self._searched = 0
            if len(self.pending) > self.max_event:
                raise StreamError(
                    f"an event grew past {self.max_event} bytes without ending",
                    reason="malformed_stream",
                )
        else:
            events = buf
            self.pending = b""
            self._searched = 0
        # A released CR may yet be followed by the LF of its own line ending.
        self.pending_cr = end == len(buf) and events[-1:] == b"\r"
        self._note(events)
        return events

    def _note(self, events: bytes) -> None:
        if not (events.startswith(b"data:") or has_data(events)):
            return  # comments, pings, other fields: not progress
        now = self.last_event_at = time.monotonic()
        self.data_events += 1
        # Kept, not searched: the terminator is looked for once, at the end.
        self._previous, self._last = self._last, events
        if self.first_data_at is None:
            self.first_data_at = now
            self._first()

    def _terminate(self) -> None:
        """At the end: did the last data event carry the stream's terminator?"""
        end = self._stream_end
        if end is None or self.data_events == 0:
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
            if not self.sse:
                self.complete = True
                return
            self._terminate()
            end = self._stream_end
            self.complete = self.first_data_at is not None and (
                end is None or self.terminated or (end == b"openai" and self.finish_seen)
            )

    def reached_end(self) -> bool:
        """True when an event stream's last data event so far is its terminator
        (``data: [DONE]``, or the configured ``stream_end``) with nothing after it:
        the answer is whole, whatever then happens to the transport."""
        if not self.sse or self.pending or self._stream_end is None or self.data_events == 0:
            return False
        if self.ended:
            return self.terminated
        self._terminate()
        whole = self.terminated
        self.terminated = self.finish_seen = False  # judged again, once, at the end
        return whole

    def drop_pending(self) -> bytes:
        """Forget the partial event held back (a failed attempt's); returns it."""
        pending, self.pending = self.pending, b""
        self._searched = 0
        return pending

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
        observer.sse = False  # stop splitting this stream
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
