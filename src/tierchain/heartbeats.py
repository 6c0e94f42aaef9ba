"""Heartbeats: tell a streaming caller what the gateway is doing while it waits.

Queued, retrying, prefilling, generating and hung all look the same to a
streaming caller that only sees silence. Heartbeats turns the request's state
events (``TierRequest.emit``: ``attempt``, ``backend_failed``,
``backend_saturated``, ``backend_skipped``, ``still_working``, ``generating``)
into SSE comment lines, one JSON object each::

    : {"state":"attempt","n":1,"of":2,"backend":"tower","regime":"local"}

and, while nothing else is sent, repeats the current state line every
``interval`` seconds as a keepalive. SSE clients ignore comment lines, so a
caller that does not look at them sees exactly the events the backend sent.

It applies to streaming requests only (``Accept: text/event-stream``, or a JSON
body with ``"stream": true``); every other request passes through byte for byte.

When the response commits (the commit rule)
    A request answered or refused within ``commit_after`` seconds keeps its
    real status and headers: a 400, 404, 413 or 502 stays that status. When
    the real answer is a 2xx event stream, the state lines queued so far are
    written in front of its first event. Only when a streaming request has
    had nothing to read for ``commit_after`` seconds does Heartbeats commit
    the response itself: ``200``, ``text/event-stream``, ``cache-control:
    no-cache``, ``x-accel-buffering: no``. From then on the inner app's own
    ``http.response.start`` is swallowed when it is a 2xx (its headers, the
    ``x-tierchain-*`` trail among them, are lost), and any other answer (a 502
    from Failover, a 504 from Budget, a 503 from Breaker) becomes one
    ``data: {"error": {...}}`` event, after which the stream ends.

Framing and safety
    Comment lines go in only at event boundaries. Inside a Failover every
    chunk that reaches this layer is whole events (Failover's observer holds a
    partial one back); used alone, Heartbeats keeps an observer of its own that
    does the same. Lines never go in after a CR that an LF may still
    complete, so an upstream event split across chunks at any byte arrives
    exactly as the backend sent it. A keepalive that falls due inside an event
    waits for the next boundary. Each line ends in a single newline and never
    gets a blank line of its own: once a stream has carried an ``id:`` field,
    the official Python SDK turns a blank line after a comment into an empty
    event it cannot decode.

Tasks and teardown (after sse-starlette)
    The inner app runs in the request's own task; the keepalive ticker is one
    side task (named ``tierchain-heartbeats``) that this layer cancels and
    awaits when the response ends or the caller leaves. Writes are serialised
    with a lock and nothing is written after the final chunk. ``receive`` is
    only observed, never read on the app's behalf, so ``http.disconnect``
    reaches the inner app (Failover's disconnect guard) untouched.

Deliberate divergences: heartbeats are comments, never empty ``data:`` frames,
data-less ``event:`` frames or empty-choices chunks; with no state event yet
the line says ``{"state":"waiting"}``; used alone (no Failover inside),
Heartbeats itself emits ``generating`` when the first data event passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections import deque
from typing import Any

from opentelemetry import trace

from ._types import ASGIApp, Headers, Message, Receive, Scope, Send
from .observer import Observer, whole_events
from .request import StateEvent, TierRequest
from .sse import (
    comment_line,
    error_event,
    error_json,
    is_event_stream,
)
from .telemetry import STREAM_HEARTBEATS, labelled, log_event

__all__ = ["TASK_NAME", "Heartbeats"]

_now = time.monotonic

TASK_NAME = "tierchain-heartbeats"
"""The name of the keepalive side task (one per streaming request)."""

_BODYLESS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE", "TRACE"})
_SNIFF_LIMIT = 32 * 2**20  # request bytes kept to read "stream" when nothing inside did
_ANSWER_LIMIT = 2**20  # bytes of a late non-stream answer kept to turn into one event
_OWN_HEADERS: Headers = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_WAITING_STATE: StateEvent = {"state": "waiting"}
_NO_LOCK: contextlib.nullcontext[None] = contextlib.nullcontext()

# Phases of one response.
_WAITING = 0  # nothing sent yet
_RELAY = 1  # the inner app's own event stream started; lines go in at its boundaries
_OWN = 2  # Heartbeats committed the response itself
_PASS = 3  # not ours: every message passes through untouched
_DONE = 4  # the final chunk went out


def _accepts_event_stream(headers: Any) -> bool:
    for key, value in headers:
        if key.lower() == b"accept":
            for item in value.split(b","):
                if item.split(b";", 1)[0].strip().lower() == b"text/event-stream":
                    return True
    return False


def _sniff_stream(parts: list[bytes]) -> bool:
    try:
        data = json.loads(b"".join(parts))
    except (UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and data.get("stream") is True


def _check_seconds(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return value


def _late_answer_event(status: int, body: bytes) -> bytes:
    """One SSE event standing for an answer that arrived after our own commit."""
    try:
        data: Any = json.loads(body) if body else None
    except (UnicodeDecodeError, ValueError):
        data = None
    if 200 <= status < 300 and isinstance(data, dict) and "error" not in data:
        payload: Any = data  # a whole non-stream answer: one data event
    elif isinstance(data, dict) and isinstance(data.get("error"), dict):
        payload = {"error": data["error"]}
    else:
        message = f"the gateway answered {status}"
        if isinstance(data, dict) and isinstance(data.get("error"), str):
            message = data["error"]
        elif data is None and body:
            message += ": " + body[:500].decode("utf-8", "replace")
        payload = error_json(message, "upstream_error", f"http_{status}")
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, default=str)
    return b"data: " + text.encode() + b"\n\n"


class Heartbeats:
    """Turn state events into SSE comment lines and keep a quiet stream alive.

    ``interval``: seconds of silence after which the current state line is
    repeated; 0 keeps the state lines and drops the keepalives.
    ``commit_after``: seconds a streaming request may go with nothing sent
    before Heartbeats commits ``200 text/event-stream`` itself (see the module
    docstring for the rule). ``max_queued``: state events kept while they
    cannot be written yet (before the commit, or inside an upstream event);
    beyond it the oldest are dropped.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        interval: float = 10.0,
        commit_after: float = 1.0,
        max_queued: int = 64,
    ) -> None:
        self.app = app
        self.interval = _check_seconds("interval", interval)
        self.commit_after = _check_seconds("commit_after", commit_after)
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued!r}")
        self.max_queued = int(max_queued)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        accept = _accepts_event_stream(scope.get("headers", ()))
        if not accept and scope.get("method") in _BODYLESS:
            return await self.app(scope, receive, send)
        await _Stream(self, scope, receive, send, accept).run()


class _Stream:
    """One request's heartbeat state: phase, queued events, tail, ticker."""

    def __init__(
        self, hb: Heartbeats, scope: Scope, receive: Receive, send: Send, accept: bool
    ) -> None:
        self.hb = hb
        self.scope = scope
        self._receive = receive
        self._send = send
        self.req = TierRequest.of(scope)
        self.accept = accept
        self.phase = _WAITING
        # Made when the ticker starts: until then no one else writes, and no one waits.
        self.lock: asyncio.Lock | contextlib.nullcontext[None] = _NO_LOCK
        self.wake: asyncio.Event | None = None
        self.queue: deque[StateEvent] = deque(maxlen=hb.max_queued)
        self.last = b""  # the last relayed chunk (whole events): is a CR pending?
        self.after_own = True  # the last bytes written are our own lines: a boundary
        self.keepalive_due = False
        self.started = time.monotonic()
        self.last_output = self.started
        self.body_parts: list[bytes] | None = None if accept else []
        self.body_size = 0
        self.body_done = False
        self.sniffed: bool | None = None
        self.gone = False
        self.observer: Observer | None = None  # alone (no Failover inside): our own
        self.said_generating = False
        self.late_status: int | None = None  # own phase: a non-stream answer being collected
        self.late_body: list[bytes] = []
        self.late_size = 0
        self.inner_started = False
        self.span = trace.get_current_span()
        self.recording = self.span.is_recording()
        self.handle: asyncio.TimerHandle | None = None
        self.ticker: asyncio.Task[None] | None = None
        self.in_send = False  # a relayed chunk is being sent (without the lock)
        self.ticker_writing = False  # the ticker is sending its lines (under the lock)

    def _wake(self) -> None:
        if self.wake is not None:
            self.wake.set()

    # -- the request ---------------------------------------------------------

    def streaming(self) -> bool | None:
        """True/False once known; None while the body that says so is still arriving."""
        if self.accept:
            return True
        if self.req.streaming is not None:
            return self.req.streaming
        if self.sniffed is None and self.body_done:
            parts, self.body_parts = self.body_parts, None
            self.sniffed = parts is not None and _sniff_stream(parts)
        return self.sniffed

    async def receive(self) -> Message:
        message = await self._receive()
        kind = message["type"]
        if kind == "http.request":
            if not self.body_done:
                chunk = message.get("body", b"")
                if chunk and self.body_parts is not None:
                    self.body_size += len(chunk)
                    if self.body_size > _SNIFF_LIMIT:
                        self.body_parts = None
                    else:
                        self.body_parts.append(chunk)
                if not message.get("more_body", False):
                    self.body_done = True
                    self._wake()
        elif kind == "http.disconnect":
            self.gone = True
            self._wake()
        return message

    def on_event(self, event: StateEvent) -> None:
        if self.phase >= _PASS:
            return
        queue = self.queue
        if queue and queue[-1].get("state") == event.get("state") == "still_working":
            queue[-1] = event  # a newer "still working" replaces the one not yet shown
        else:
            queue.append(event)
        self._wake()

    # -- writing ---------------------------------------------------------------

    def _line(self, event: StateEvent, keepalive: bool) -> bytes:
        state = str(event.get("state"))
        try:
            line = comment_line(event)
        except (TypeError, ValueError):  # a field that is not JSON: say the state only
            line = comment_line({"state": state})
        labelled(STREAM_HEARTBEATS, state).inc()
        if self.recording:
            self.span.add_event("stream.heartbeat", {"state": state, "keepalive": keepalive})
        return line

    def _lines(self) -> bytes:
        """The queued state lines, or (none queued) the current state as a keepalive."""
        if self.keepalive_due:
            self.keepalive_due = False
            self._wake()  # the ticker stopped timing while it waited for a boundary
        if self.queue:
            events = list(self.queue)
            self.queue.clear()
            return b"".join(self._line(e, False) for e in events)
        state = self.req.state or _WAITING_STATE
        if state.get("state") == "generating":
            observer = self.observer or self.req.observer
            last = observer.last_event_at if observer is not None else None
            if last is not None:  # while a gap grows, say how long it is
                state = {**state, "idle_s": round(time.monotonic() - last, 1)}
        return self._line(state, True)

    @property
    def _pending(self) -> bool:
        return bool(self.queue) or self.keepalive_due

    def _at_boundary(self) -> bool:
        return self.after_own or self.last[-1:] != b"\r"

    def _boundary_before(self, chunk: bytes) -> bool:
        if self.after_own:
            return True
        # After a CR, an LF would complete that line ending: not a boundary then.
        return not (self.last[-1:] == b"\r" and chunk.startswith(b"\n"))

    async def _write(self, data: bytes, *, more: bool = True) -> None:
        if not more:
            self.phase = _DONE
        await self._send({"type": "http.response.body", "body": data, "more_body": more})
        self.last_output = time.monotonic()

    async def _commit_own(self) -> None:
        """Commit 200 text/event-stream ourselves and show every queued state line."""
        start = {"type": "http.response.start", "status": 200, "headers": list(_OWN_HEADERS)}
        await self._send(start)
        self.phase = _OWN
        log_event("stream.committed", waited_s=round(time.monotonic() - self.started, 3))
        await self._write(self._lines())
        self.after_own = True

    async def _finish_own(self, event: bytes) -> None:
        """End our own stream with ``event`` (an error event, or a whole late answer)."""
        if self.observer is not None:
            self.observer.drop_pending()  # a partial event is never shown half
        head = self._lines() if self.queue else b""  # only whole events went out
        await self._write(head + event, more=False)

    # -- the inner app's send ----------------------------------------------------

    async def send(self, message: Message) -> None:
        phase = self.phase
        if phase == _RELAY:
            if message["type"] == "http.response.body" and not (
                self.ticker_writing or self.queue or self.keepalive_due or self.observer is not None
            ):
                # The hot path: a relayed upstream chunk with nothing to add to it.
                # No lock: the ticker sees ``in_send`` and leaves its line for the next
                # boundary, and a chunk arriving while the ticker writes takes the lock.
                chunk: bytes = message.get("body", b"")
                if chunk:
                    self.last = chunk
                    self.after_own = False
                    if not message.get("more_body", False):
                        self.phase = _DONE
                elif message.get("more_body", False):
                    return
                else:
                    self.phase = _DONE
                self.in_send = True
                await self._send(message)  # (if it raises, the response is over anyway)
                self.last_output = _now()
                self._sent()
                return
        elif phase == _PASS:
            await self._send(message)
            return
        kind = message["type"]
        if kind == "http.response.start":
            await self._on_start(message)
        elif kind == "http.response.body":
            await self._on_body(message)
        elif self.phase != _OWN:  # e.g. trailers; after our own commit they cannot follow
            await self._send(message)

    def _sent(self) -> None:
        """A relayed chunk's send is back."""
        self.in_send = False
        if self.keepalive_due:
            self._wake()  # the ticker held a line back while this send was out

    async def _on_start(self, message: Message) -> None:
        async with self.lock:
            self.inner_started = True
            status = int(message["status"])
            headers = message.get("headers", ())
            sse = 200 <= status < 300 and is_event_stream(headers)
            if sse and not self.req.in_chain and self.phase in (_WAITING, _OWN):
                self.observer = Observer()  # alone: we pass on whole events ourselves
                self.observer.start(status, list(headers))
            if self.phase == _WAITING:
                if sse and self.streaming():
                    self.phase = _RELAY
                    # State lines change the body's length: the server frames it.
                    message = {
                        **message,
                        "headers": [(k, v) for k, v in headers if k.lower() != b"content-length"],
                    }
                else:
                    self.phase = _PASS
                    self.queue.clear()
                self._wake()
                # No lock may be held yet (no ticker): a ticker started meanwhile sees
                # in_send and leaves its lines for later.
                self.in_send = True
                try:
                    await self._send(message)
                finally:
                    self._sent()
            elif self.phase == _OWN and not sse:
                self.late_status = status  # its body becomes one event

    async def _on_body(self, message: Message) -> None:
        if self.phase == _RELAY and not self.ticker_writing:
            # As in the hot path (see send), with state lines or detection to do.
            self.in_send = True
            try:
                await self._relay(message)
            finally:
                self._sent()
            return
        async with self.lock:
            phase = self.phase
            if phase == _DONE:
                return
            if phase == _WAITING:  # a body before any start: not ours to judge
                await self._send(message)
                return
            if self.late_status is not None:
                chunk: bytes = message.get("body", b"")
                more = bool(message.get("more_body", False))
                if chunk and self.late_size < _ANSWER_LIMIT:
                    self.late_body.append(chunk)
                    self.late_size += len(chunk)
                if not more:
                    body = b"".join(self.late_body)
                    await self._finish_own(_late_answer_event(self.late_status, body))
                return
            await self._relay(message)

    async def _relay(self, message: Message) -> None:
        """Pass an upstream chunk on, with any due state lines at its boundaries."""
        observer = self.observer
        if observer is not None:
            whole = whole_events(observer, message)
            if whole is None:
                return  # part of an event: held until it is whole
            message = whole
            if observer.first_data_at is not None and not self.said_generating:
                self.said_generating = True  # alone, we say "generating" ourselves
                if (self.req.state or {}).get("state") != "generating":
                    self.req.emit("generating")
        chunk: bytes = message.get("body", b"")
        more = bool(message.get("more_body", False))
        if not chunk and more:
            return
        if not (self.queue or self.keepalive_due):
            if chunk:
                self.last = chunk
                self.after_own = False
            if not more:
                self.phase = _DONE
            await self._send(message)
            self.last_output = time.monotonic()
            return
        out = b""
        if chunk and self._boundary_before(chunk):
            out = self._lines()
        if chunk:
            self.last = chunk
            self.after_own = False
        out += chunk
        if more and self._pending and self._at_boundary():
            out += self._lines()  # a state line or keepalive that waited for this boundary
        await self._write(out, more=more)

    # -- the keepalive ticker ------------------------------------------------------

    async def tick(self) -> None:
        try:
            while await self._step():
                pass
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken write must not break the request
            log_event("stream.heartbeat_failed", level=30, error=repr(exc))

    async def _step(self) -> bool:
        """Do what is due now, then wait for the next thing; False when done."""
        wake = self.wake
        assert wake is not None
        wake.clear()
        if self.gone or self.phase >= _PASS:
            return False
        now = time.monotonic()
        timeout: float | None = None
        if self.phase == _WAITING:
            streaming = self.streaming()
            if streaming is False:
                return False
            due = self.started + self.hb.commit_after
            if streaming and now >= due:
                async with self.lock:
                    if self.phase == _WAITING and not self.gone:
                        await self._commit_own()
                return True
            if now < due:
                timeout = due - now
        else:
            interval = self.hb.interval
            async with self.lock:
                if self.phase in (_RELAY, _OWN) and not self.gone:
                    quiet = time.monotonic() - self.last_output
                    keepalive = interval > 0 and quiet >= interval
                    owed = bool(self.queue) or keepalive or self.keepalive_due
                    if owed and not self.in_send and self._at_boundary():
                        self.ticker_writing = True
                        try:
                            await self._write(self._lines())
                            self.after_own = True
                        finally:
                            self.ticker_writing = False
                    elif keepalive:
                        self.keepalive_due = True  # written at the next event boundary
            if interval > 0 and not self.keepalive_due:
                timeout = max(0.0, self.last_output + interval - time.monotonic())
        if timeout is None:
            await wake.wait()
        elif timeout > 0:
            try:
                async with asyncio.timeout(timeout):
                    await wake.wait()
            except TimeoutError:
                pass
        return True

    # -- the request's life ----------------------------------------------------------

    def _spawn_ticker(self) -> None:
        """Start the keepalive ticker: only once the response has been quiet a while."""
        self.handle = None
        if self.phase < _PASS and not self.gone:
            self.lock = asyncio.Lock()
            self.wake = asyncio.Event()
            self.ticker = asyncio.create_task(self.tick(), name=TASK_NAME)

    async def run(self) -> None:
        unsubscribe = self.req.subscribe(self.on_event)
        # No task for a request that is over before anything could be due: the
        # ticker starts when the commit (or the first keepalive) could fall due.
        hb = self.hb
        first_due = min(hb.commit_after, hb.interval) if hb.interval > 0 else hb.commit_after
        self.handle = asyncio.get_running_loop().call_later(first_due, self._spawn_ticker)
        try:
            try:
                await self.hb.app(self.scope, self.receive, self.send)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                async with self.lock:
                    if self.phase == _OWN and not self.gone:
                        log_event("stream.app_error", level=40, error=repr(exc))
                        await self._finish_own(
                            error_event(
                                "the gateway failed while answering",
                                "internal_error",
                                "internal_error",
                            )
                        )
                raise
            # Only the ticker commits our own response or holds the lock here:
            # without one there is nothing to finish.
            if self.ticker is not None:
                await self._finish()
        finally:
            unsubscribe()
            if self.handle is not None:
                self.handle.cancel()
            ticker = self.ticker
            if ticker is not None:
                ticker.cancel()
                await asyncio.wait([ticker])

    async def _finish(self) -> None:
        """The inner app returned: end our own response if we committed one."""
        async with self.lock:
            if self.phase == _OWN and not self.gone:
                if self.late_status is not None:
                    body = b"".join(self.late_body)
                    await self._finish_own(_late_answer_event(self.late_status, body))
                elif not self.inner_started:
                    await self._finish_own(
                        error_event(
                            "the gateway ended without an answer",
                            "upstream_error",
                            "no_response",
                        )
                    )
                else:
                    await self._finish_own(b"")
