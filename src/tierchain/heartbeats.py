"""Heartbeats: tell a streaming caller what the gateway is doing while it waits.

Queued, retrying, prefilling, generating and hung all look the same to a streaming caller
that only sees silence. Heartbeats turns the request's state events (``TierRequest.emit``)
into SSE comment lines, one JSON object each::

    : {"state":"attempt","n":1,"of":2,"backend":"tower","regime":"local"}

and, while nothing else is sent, repeats the current state line every ``interval`` seconds
as a keepalive. Streaming requests only (``Accept: text/event-stream``, or a JSON body with
``"stream": true``); every other request, and every request in a wire format without
comments (Ollama's NDJSON), passes through byte for byte.

The commit rule: an answer within ``commit_after`` seconds keeps its real status and
headers; only a streaming request that had nothing to read for that long is committed by
Heartbeats itself (``200 text/event-stream``), after which a late error becomes one error
event in the request's wire format (``WireFormat.error_bytes``, :mod:`tierchain.formats`).
Lines go in only at event boundaries, never after a CR an LF may complete, never as a blank
line of their own.

No stream has a task or a timer of its own while it waits: its next commit or keepalive is
an entry on the package's scheduler, which writes the line at once in the request's context;
a write that has to wait becomes a short task (``tierchain-heartbeats``) the request owns.
Its writes go through one lock (as sse-starlette's ``_ping``). docs/heartbeats.md has the
whole contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import types
from collections.abc import Awaitable
from datetime import timedelta
from typing import Any

from . import formats
from ._checks import count, duration
from ._responses import FinalWrites
from ._runtime import clock, deadlines
from ._runtime.deadlines import EARLY
from ._runtime.eager import finished, start_eagerly
from ._state_lines import state_line, state_lines
from ._stream_request import SNIFF_LIMIT, SNIFF_PARSE, accepts_event_stream, says_stream
from ._types import ASGIApp, Headers, Message, Receive, Scope, Send
from .errors import CallerStalled
from .observer import Observer, nothing_sent, whole_events
from .request import SCOPE_KEY, StateEvent, TierRequest
from .sse import is_event_stream
from .telemetry import current_span, log_event
from .wire import LateAnswer, recognise

__all__ = ["TASK_NAME", "Heartbeats"]


TASK_NAME = "tierchain-heartbeats"
"""The name of the keepalive side task (one per streaming request)."""

_BODYLESS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE", "TRACE"})
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


_COROUTINE = types.CoroutineType  # what a server's ``async def send`` returns

_LOOK_AGAIN = 0.002  # a line held beside a relayed send that is out: look again this soon
_HELD_LOOK = 0.5  # a commit held while every tier so far said 429: look again this soon
_FAILED = ("the gateway failed while answering", "internal_error", "internal_error")
_NO_ANSWER = ("the gateway ended without an answer", "upstream_error", "no_response")
_ASK_AGAIN = 0.05  # a long body, too long to parse here: is "stream" known yet? ask this soon

MIN_INTERVAL = 0.02
"""The shortest keepalive interval: at most 50 keepalive lines a second per stream."""

KEEPALIVE_SLACK = 1 / 10
"""A keepalive may go out this share of ``interval`` early, at a wake the loop makes for
another stream's: a thousand parked streams' keepalives then share about one wake a second
instead of one each (a wake of its own costs about as much as a dozen lines). Streams that
shared a wake stay together: each goes early once; no silence lasts longer than ``interval``."""


class Heartbeats:
    """Turn state events into SSE comment lines and keep a quiet stream alive.

    ``interval``: seconds of silence after which the current state line is repeated; 0 keeps
    the state lines and drops the keepalives. ``commit_after``: seconds a streaming request
    may go with nothing sent before Heartbeats commits ``200 text/event-stream`` itself (see
    the module docstring for the rule). ``max_queued``: state events kept while they cannot
    be written yet (before the commit, or inside an upstream event); beyond it the oldest
    are dropped.

    Options: [Heartbeats options](heartbeats.md#options).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        interval: float | timedelta = 10.0,
        commit_after: float | timedelta = 1.0,
        max_queued: int = 64,
    ) -> None:
        self.app = app
        self.interval = duration("interval", interval, allow_zero=True)
        if 0 < self.interval < MIN_INTERVAL:
            # A floor no configuration can go under: 1 ms wrote 26 MB to one caller.
            raise ValueError(f"interval must be 0 (off) or >= {MIN_INTERVAL}s, got {interval!r}")
        self.commit_after = duration("commit_after", commit_after, allow_zero=True)
        self.max_queued = count("max_queued", max_queued)
        # How early a keepalive may go to share a wake (at least EARLY, the scheduler's).
        self.slack = max(EARLY, self.interval * KEEPALIVE_SLACK)
        # When a stream's commit or first keepalive could first fall due (interval 0: none).
        self.first_due = min(self.commit_after, self.interval or self.commit_after)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        accept = accepts_event_stream(scope.get("headers", ()))
        if not accept and scope.get("method") in _BODYLESS:
            return await self.app(scope, receive, send)
        # The stream's life, in this frame (a waiting stream holds one frame less).
        stream = _Stream(self, scope, receive, send, accept)
        # It listens for state events; its commit (or first keepalive) is timed only if the
        # request outlives its young phase (most do not). It goes live when that falls due.
        (req := stream.req).listen(stream.on_event)
        young = req.after_young(stream.started, stream.started + self.first_due, stream.arm)
        try:
            await self.app(scope, stream.inward_receive, stream.send)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await stream.finish(exc)
            raise
        else:
            # Only a live stream can have committed our own response or hold the lock.
            if stream.live:
                await stream.finish()
        finally:
            writer = stream.close()
            req.end_young(young)
            if writer is not None:
                await asyncio.wait([writer])


# Marks a write run at once (never awaited nor cancelled: done before the loop goes on).
_AT_ONCE: Any = object()


class _Stream:
    """One streaming request, as Heartbeats sees it (each field's comment in ``__init__``):

    - the response: ``phase`` (waiting, relaying the app's event stream, our own,
      passing through, done), ``inner_started``, ``observer`` (ours, used alone), ``late``;
    - what is owed: ``queue``, ``keepalive_due``, ``rearm_after``; whether a line is owed
      at a given time is :meth:`_owed`, whether it can go in :meth:`_can_write`;
    - the output's tail: ``last`` (a CR an LF may complete), ``last_output`` (when);
    - what the request says of streaming (:meth:`streaming`): ``accept``, else its body's
      ``"stream": true`` (``parts``, ``body_done``, ``sniffed``; ``awaiting`` a commit);
    - ``entry``, its next commit or keepalive on the scheduler; ``gone``;
    - its own writes, shaped as sse-starlette's ``_ping``: ``lock`` (made when the stream
      goes ``live``, its first due time: until then no one else writes), ``active`` (False
      for good once a write of ours failed); ``relaying`` and ``flight``, a relayed chunk's
      send still out (:meth:`sending`: no line of ours goes in meanwhile; the hot path adds
      no coroutine of its own); ``writing``, our lines being sent under the lock; ``task``,
      the write the timer started (at most one), owned by the request.
    """

    # Thousands may wait at once: slots keep each small (the writer's fields too: no object).
    __slots__ = (
        "_send",
        "accept",
        "active",
        "awaiting",
        "body_done",
        "body_size",
        "context",
        "entry",
        "flight",
        "gone",
        "hb",
        "inner_started",
        "inward_receive",
        "keepalive_due",
        "last",
        "last_output",
        "late",
        "live",
        "lock",
        "observer",
        "outer_receive",
        "parts",
        "path",
        "phase",
        "queue",
        "rearm_after",
        "relaying",
        "req",
        "said_generating",
        "sniffed",
        "span",
        "started",
        "task",
        "writing",
    )

    def __init__(
        self, hb: Heartbeats, scope: Scope, receive: Receive, send: Send, accept: bool
    ) -> None:
        self.hb = hb
        self.outer_receive = receive
        self.inward_receive = self.receive  # (one bound method: the receive handed inward)
        self._send = send
        made = SCOPE_KEY not in scope  # (the usual case: outermost, the request starts here)
        req = TierRequest.of(scope)
        self.started = req.started if made else clock.now()  # (a clock reading, read once)
        self.req = req
        self.path: str = scope.get("path", "")
        # Its Accept header, else its body's "stream": true (``parts``: None, not kept).
        self.accept = accept
        self.body_done = False
        self.awaiting = False  # a commit waits for the body to say
        self.parts: list[bytes] | None = None if accept else []
        self.body_size = 0
        self.sniffed: bool | None = None
        self.phase = _WAITING
        self.entry: deadlines.Deadline | None = None  # its next commit or keepalive
        self.context = contextvars.copy_context()  # the request's: for that write
        self.rearm_after = False  # a held-back keepalive went out: time the next one
        self.queue: list[StateEvent] = []  # at most hb.max_queued, the oldest dropped
        self.last = b""  # the last relayed chunk (whole events); b"": our own lines were last
        self.keepalive_due = False
        self.last_output = self.started
        self.gone = False
        self.observer: Observer | None = None  # alone (no Failover inside): our own
        self.said_generating = False
        self.late: LateAnswer | None = None  # own phase: a non-stream answer being collected
        self.inner_started = False
        self.span = current_span()
        # The writer (see the class docstring).
        self.lock: asyncio.Lock | contextlib.nullcontext[None] = _NO_LOCK
        self.live = False
        self.active = True
        self.relaying = False
        self.flight: types.CoroutineType[Any, Any, Any] | None = None
        self.writing = False
        self.task: asyncio.Task[Any] | None = None
        req.body_watch = self  # (a Failover holding inward_receive reads the body past us)

    def sending(self) -> bool:
        """Is a relayed chunk's send still out? (The server's own coroutine is asked,
        through the runtime room's ``finished``: out until it is closed.)"""
        if self.relaying:
            return True
        flight = self.flight
        if flight is None:
            return False
        if not finished(flight):
            return True
        self.flight = None
        return False

    def arm(self) -> None:
        """Time its commit or first keepalive (now, or when the young phase ends)."""
        if self.entry is None and not self.gone and not self.live:
            first_due = self.hb.first_due
            self.entry = deadlines.schedule_at(self.started + first_due, self.due, lane=first_due)

    def go_live(self) -> None:
        self.live = True
        self.lock = asyncio.Lock()

    # -- the request ---------------------------------------------------------

    def wire(self) -> str:
        """The request's wire format: Failover's (from the route), else from the path."""
        return self.req.wire or recognise(self.path)

    def streaming(self) -> bool | None:
        """True/False once known; None while the body that says so is still arriving. A
        request whose wire format has no comments (``WireFormat.comments``: Ollama's
        NDJSON) is never ours to commit or to put lines into: False."""
        if not formats.of(self.wire()).comments:
            return False
        if self.accept:
            return True
        if self.req.streaming is not None:
            return self.req.streaming
        if self.sniffed is None and self.body_done:  # parsed once, when complete
            if self.body_size > SNIFF_PARSE:
                # Too long to parse here: the layer inside that reads it anyway says (Failover).
                self.parts = None
                return None
            parts, self.parts = self.parts, None
            self.sniffed = parts is not None and says_stream(parts)
        return self.sniffed

    def receive(self) -> Awaitable[Message]:
        """The inner app's receive: watched while the body arrives (it may say
        "stream"), then the host's own (no frame of ours for a waiting stream)."""
        if self.body_done:
            return self.outer_receive()
        return self._receive_body()

    async def _receive_body(self) -> Message:
        message = await self.outer_receive()
        kind = message["type"]
        if kind == "http.request":
            if not self.body_done:
                chunk = message.get("body", b"")
                parts = self.parts
                if chunk and parts is not None:
                    size = self.body_size = self.body_size + len(chunk)
                    if size > SNIFF_LIMIT:
                        self.parts = None
                    else:
                        parts.append(chunk)
                if not message.get("more_body", False):
                    self._body_ended()
        elif kind == "http.disconnect":
            self.gone = True
        return message

    def body_read(self, body: bytes) -> None:
        """Failover read the whole ``body`` past our receive (``TierRequest.body_watch``)."""
        self.body_size = size = len(body)
        if self.parts is not None:
            self.parts = [body] if size <= SNIFF_LIMIT else None
        self._body_ended()

    def _body_ended(self) -> None:
        self.body_done = True
        if self.awaiting:  # a commit waits for the body to say
            self.awaiting = False
            self._kick()

    def on_event(self, event: StateEvent) -> None:
        if self.phase >= _PASS:
            return
        queue = self.queue
        if (
            queue
            and event.get("state") == "still_working"
            and queue[-1].get("state") == "still_working"
        ):
            queue[-1] = event  # a newer "still working" replaces the one not yet shown
        else:
            queue.append(event)
            if len(queue) > self.hb.max_queued:
                del queue[0]
        if self.live and self.phase != _WAITING:
            self._kick()

    # -- writing ---------------------------------------------------------------

    def _lines(self) -> bytes:
        """The queued state lines, or (none queued) the current state as a keepalive."""
        if self.keepalive_due:
            self.keepalive_due = False
            self.rearm_after = True  # the timer stopped while it waited for a boundary
        if self.queue:
            events, self.queue = self.queue, []
            return state_lines(events, self.span)
        state = self.req.state or _WAITING_STATE
        if state.get("state") == "generating":
            observer = self.observer or self.req.observer
            last = observer.last_event_at if observer is not None else None
            if last is not None:  # while a gap grows, say how long it is
                state = {**state, "idle_s": round(clock.now() - last, 1)}
        return state_line(state, self.span, True)

    @property
    def _pending(self) -> bool:
        """A line is waiting for its place: state lines queued, or a keepalive held back."""
        return bool(self.queue) or self.keepalive_due

    def _at_boundary(self) -> bool:
        return self.last[-1:] != b"\r"  # (our own lines last: b"", a boundary)

    async def _write(self, data: bytes, *, more: bool = True) -> None:
        if not more:
            self.phase = _DONE
        await self._send({"type": "http.response.body", "body": data, "more_body": more})
        self._after_send()

    async def _commit_own(self) -> None:
        """Commit 200 text/event-stream ourselves and show every queued state line."""
        start = {"type": "http.response.start", "status": 200, "headers": list(_OWN_HEADERS)}
        await self._send(start)
        self.phase = _OWN
        log_event("stream.committed", waited_s=round(clock.now() - self.started, 3))
        await self._write(self._lines())
        self.last = b""  # our own lines were last: a boundary

    async def _finish_own(self, event: bytes) -> None:
        """End our own stream with ``event`` (an error event, or a whole late answer)."""
        if self.observer is not None:
            self.observer.drop_pending()  # a partial event is never shown half
        head = self._lines() if self.queue else b""  # only whole events went out
        await self._write(head + event, more=False)

    # -- the inner app's send ----------------------------------------------------

    def send(self, message: Message) -> Awaitable[None]:
        """The inner app's send. A relayed chunk with nothing to add goes straight on."""
        if self.phase == _RELAY:
            if message["type"] == "http.response.body" and not (
                self.writing or self.keepalive_due or self.observer is not None
            ):
                # The hot path, with no coroutine and no lock of ours: the timer sees the send
                # out (:meth:`sending`) and holds its lines until it is back; a chunk arriving
                # while our own lines are written takes the lock (``_send_slow``).
                if self.queue:
                    if self.rearm_after:
                        return self._send_slow(message)
                    # State lines to put in at this chunk's boundaries (the first data
                    # event of most requests): written into it, then the same hot path.
                    relayed = self._relayed(message)
                    if relayed is None:
                        return nothing_sent()
                    message = relayed
                    if self.phase != _DONE:
                        self.last_output = clock.now()
                else:
                    chunk = message.get("body", b"")
                    if chunk:
                        self.last = chunk
                        if message.get("more_body", False):
                            self.last_output = clock.now()  # the next keepalive's time
                        else:
                            # The end: no clock read, nothing reads last_output after it.
                            self.phase = _DONE
                    elif message.get("more_body", False):
                        return nothing_sent()
                    else:
                        self.phase = _DONE
                send = self._send  # (read, then called: see Failover's Responder.send)
                sending = send(message)
                if type(sending) is not _COROUTINE:
                    return self._relay(sending)  # a server whose send is not a coroutine
                self.flight = sending
                return sending
            return self._send_slow(message)
        phase = self.phase
        if phase == _WAITING:
            if message["type"] == "http.response.start" and not self.live:
                # The inner app's start before the stream went live (most requests): no lock,
                # and marked as out (``flight``) until the server's send coroutine is done.
                started = self._started(message)
                assert started is not None  # (a message: it was waiting)
                sending = self._send(started)
                if type(sending) is not _COROUTINE:
                    return self._relay(sending)  # a server whose send is not a coroutine
                self.flight = sending
                return sending
        elif phase == _PASS:
            return self._send(message)  # not ours: untouched, no frame of ours
        return self._send_slow(message)

    async def _relay(self, sending: Awaitable[None], *, body: bool = False) -> None:
        """Await a relayed message's send, marked as out until it is back (a line that
        fell due meanwhile is written then)."""
        self.relaying = True
        try:
            await sending
            if body:
                self._after_send()
        finally:
            self.relaying = False
            if self.live and self._pending:
                self._kick()  # a line was held back while this send was out

    async def _send_slow(self, message: Message) -> None:
        if self.phase == _PASS:
            await self._send(message)
            return
        kind = message["type"]
        if kind == "http.response.start":
            async with self.lock:  # (not live: no one else writes yet, _NO_LOCK)
                out = self._started(message)
                if out is not None:
                    await self._relay(self._send(out))
        elif kind == "http.response.body":
            if self.phase == _RELAY and not self.writing:
                # As in the hot path, with state lines or detection to do.
                out = self._relayed(message)
                if out is not None:
                    await self._relay(self._send(out), body=True)
                return
            await self._on_body(message)
        elif self.phase != _OWN:  # e.g. trailers; after our own commit they cannot follow
            await self._send(message)

    def _started(self, message: Message) -> Message | None:
        """The inner app's start: the message to relay (an event stream, or a response
        that passes), or None when our own response is already under way."""
        self.inner_started = True
        status = int(message["status"])
        headers = message.get("headers", ())
        req = self.req
        in_chain = req.in_chain
        chained = req.observer if in_chain else None  # it has read the headers
        sse = 200 <= status < 300 and (
            chained.sse if chained is not None else is_event_stream(headers)
        )
        phase = self.phase
        if sse and not in_chain and phase in (_WAITING, _OWN):
            self.observer = Observer(wire=self.wire())  # alone: we pass on whole events
            self.observer.start(status, list(headers))
        if phase == _WAITING:
            streams: bool | None = False
            if sse:
                streams = self.streaming()
                if streams is None:  # (a body too long to parse here: the answer says)
                    streams = True
            if streams:
                self.phase = _RELAY
                # State lines change the body's length: the server frames it (Failover's too).
                if not in_chain:
                    message = {
                        **message,
                        "headers": [(k, v) for k, v in headers if k.lower() != b"content-length"],
                    }
            else:
                self.phase = _PASS
                self.queue.clear()
            if self.live:  # it waited for the commit: time its keepalives instead
                if self.entry is not None:
                    deadlines.cancel(self.entry)
                    self.entry = None
                self._rearm()
            return message
        if phase == _OWN and not sse:
            self.late = LateAnswer(status)  # its body becomes one event
        return None

    async def _on_body(self, message: Message) -> None:
        async with self.lock:
            phase = self.phase
            if phase == _DONE:
                return
            if phase == _WAITING:  # a body before any start: not ours to judge
                await self._send(message)
                return
            late = self.late
            if late is not None:
                late.add(message.get("body", b""))
                if not message.get("more_body", False):
                    await self._finish_own(late.event(self.wire()))
                return
            out = self._relayed(message)
            if out is not None:
                await self._send(out)
                self._after_send()

    def _after_send(self) -> None:
        """An output of ours went: time the next keepalive from it."""
        self.last_output = clock.now()
        if self.rearm_after:
            self._rearm()

    def _relayed(self, message: Message) -> Message | None:
        """An upstream chunk to pass on, with any due state lines at its boundaries
        (None: nothing to send yet)."""
        observer = self.observer
        if observer is not None:
            whole = whole_events(observer, message)
            if whole is None:
                return None  # part of an event: held until it is whole
            message = whole
            if observer.first_data_at is not None and not self.said_generating:
                self.said_generating = True  # alone, we say "generating" ourselves
                if (self.req.state or {}).get("state") != "generating":
                    self.req.emit("generating")
        chunk: bytes = message.get("body", b"")
        more = bool(message.get("more_body", False))
        if not chunk and more:
            return None
        if not self._pending:
            if chunk:
                self.last = chunk
            if not more:
                self.phase = _DONE
            return message
        out = chunk
        if chunk:
            last, self.last = self.last, chunk
            # After a CR, an LF would complete that line ending: not a boundary then.
            if not (chunk[:1] == b"\n" and last[-1:] == b"\r"):
                out = self._lines() + chunk  # everything owed: none is left for a boundary
            elif more and self._at_boundary():  # (still owed: nothing was taken)
                out += self._lines()  # a state line or keepalive that waited for this boundary
        if not more:
            self.phase = _DONE
        return {"type": "http.response.body", "body": out, "more_body": more}

    # -- the keepalive timer ------------------------------------------------------

    def due(self) -> None:
        """The scheduler's call: this stream's commit may be due (within the scheduler's
        tolerance, ``EARLY``), or its keepalive (within ``slack``)."""
        self.entry = None
        if self.gone or self.phase >= _PASS:
            return
        now = clock.now() + EARLY
        if not self.live:
            self.go_live()
        hb = self.hb
        if self.phase == _WAITING:
            streaming = self.streaming()
            if streaming is False:
                return
            commit_at = self._commit_at(now)
            if now < commit_at:
                self.entry = deadlines.schedule_at(commit_at, self.due)
            elif streaming is None and self.body_done:  # a long body: asked again shortly
                self.entry = deadlines.schedule(_ASK_AGAIN, self.due)
            elif streaming is None:
                self.awaiting = True  # receive() starts the commit
            else:
                self._kick()
            return
        now += hb.slack - EARLY
        if not self._owed(now):
            if hb.interval > 0:  # (0: no keepalives)
                self.entry = deadlines.schedule_at(
                    self.last_output + hb.interval, self.due, lane=hb.interval, slack=hb.slack
                )
        elif self.task is None and self._can_write(now):
            self._kick(at_once=True)
        # Else a write under way times the next, or the line waits for a send or a boundary.

    def _commit_at(self, now: float) -> float:
        """When our own commit may go: ``commit_after`` into the request, but not while
        every tier tried so far answered 429 (``TierRequest.rate_limited``): a caller
        every tier refuses must get HTTP 429 with a ``Retry-After`` its SDK retries, not
        200 and an error event. Held while Failover waits out a ``Retry-After`` between
        attempts, and for ``commit_after`` into the next attempt (a tier that does not
        refuse at once gets the usual commit and keepalives)."""
        at = self.started + self.hb.commit_after
        held = self.req.rate_limited
        if held is None:
            return at
        attempt = self.req.attempt
        if attempt is not None and attempt is not held:  # a new attempt since
            return max(at, attempt.started + self.hb.commit_after)
        return max(at, now + _HELD_LOOK)  # between attempts: look again soon

    def _owed(self, now: float) -> bool:
        """Is a line owed at ``now``: a state line queued, or a keepalive (the stream
        has been quiet for ``interval``)."""
        return bool(self.queue) or self.keepalive_due or self._quiet(now)

    def _quiet(self, now: float) -> bool:
        """Has the stream been quiet for ``interval`` at ``now`` (a keepalive is due)?"""
        interval = self.hb.interval
        return interval > 0 and now >= self.last_output + interval

    def _can_write(self, now: float) -> bool:
        """Can our lines go in now? Not beside a relayed send that is still out (the
        timer looks again soon), nor inside an event (the next boundary takes them): a
        keepalive that fell due meanwhile is marked ``keepalive_due``."""
        sending = self.sending()
        if not sending and self._at_boundary():
            return True
        if self._quiet(now):
            self.keepalive_due = True
        if sending and self.entry is None:  # look again soon
            again = now + max(_LOOK_AGAIN, self.hb.interval / 10)
            self.entry = deadlines.schedule_at(again, self.due)
        return False

    def _kick(self, *, at_once: bool = False) -> None:
        """Start a write of whatever is owed, unless one is under way.

        ``at_once`` (the timer's call): run the write right here, in the request's
        context, and make a task only if it has to wait (a slow reader, the lock):
        a keepalive to a reader keeping up costs no task and no extra loop turn.
        """
        if self.task is not None or self.gone or not self.active or self.phase >= _PASS:
            return
        if not at_once:
            loop = asyncio.get_running_loop()
            self.task = loop.create_task(self._write_owed(), name=TASK_NAME, context=self.context)
            return
        self.task = _AT_ONCE  # (so nothing starts a second write meanwhile)
        try:
            task = start_eagerly(self._write_owed(), name=TASK_NAME, context=self.context)
        except BaseException:
            self.task = None
            raise
        if task is not None:  # (done at once: it cleared self.task itself)
            self.task = task

    def _rearm(self) -> None:
        """Put the stream back in the timer for its next keepalive."""
        self.rearm_after = False
        interval = self.hb.interval
        if (
            self.entry is None
            and interval > 0
            and not self.keepalive_due
            and not self.gone
            and self.active
            and self.phase in (_RELAY, _OWN)
        ):
            # Mostly now plus the interval, in its loose lane (up to slack early, shared).
            self.entry = deadlines.schedule_at(
                self.last_output + interval, self.due, lane=interval, slack=self.hb.slack
            )

    async def _write_owed(self) -> None:
        """Write what is due: our own commit, state lines, a keepalive."""
        try:
            async with self.lock:
                while not self.gone:
                    # With the timer's tolerance (a stream it woke must not be dropped).
                    now = clock.now()
                    if self.phase == _WAITING:
                        now += EARLY
                        if not self.streaming():
                            break
                        commit_at = self._commit_at(now)
                        if now >= commit_at:
                            await self._commit_own()
                        elif self.entry is None:
                            # Not yet: back in line.
                            self.entry = deadlines.schedule_at(commit_at, self.due)
                        break
                    now += self.hb.slack  # (a keepalive: within the slack it was woken with)
                    if self.phase not in (_RELAY, _OWN) or not self._owed(now):
                        break
                    if not self._can_write(now):
                        break
                    self.writing = True
                    try:
                        await self._write(self._lines())
                        self.last = b""  # our own lines were last: a boundary
                    finally:
                        self.writing = False
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken write must not break the request
            log_event("stream.heartbeat_failed", level=30, error=repr(exc))
            self.active = False
        finally:
            self.task = None
        self._rearm()

    # -- the request's life ----------------------------------------------------------

    def close(self) -> asyncio.Task[Any] | None:
        """The request is over: nothing more is due. Returns a writer to wait for, if any."""
        self.req.unsubscribe(self.on_event)  # (it refers back to us: no cycle left behind)
        self.req.body_watch = None
        del self.inward_receive  # (our own bound method: a cycle of its own, broken here)
        self.gone = True
        if self.entry is not None:
            deadlines.cancel(self.entry)
            self.entry = None
        task = self.task
        if task is not None and task is not _AT_ONCE:
            task.cancel()
            return task
        return None

    async def finish(self, failed: Exception | None = None) -> None:
        """The inner app returned, or raised ``failed``: end our own response, if we
        committed one (an error event when the app failed or sent nothing; a late
        answer as one event).

        Nothing for a caller cut for not reading (nothing more is written to it); and
        bounded by the request's ``send_timeout`` (the lock may be held by a write
        that waits on that same caller)."""
        if isinstance(failed, CallerStalled):
            return
        async with FinalWrites(self.req), self.lock:
            if self.phase != _OWN or self.gone:
                return
            fmt = formats.of(self.wire())
            if failed is not None:
                log_event("stream.app_error", level=40, error=repr(failed))
                event = fmt.error_bytes(formats.SSE, *_FAILED)
            elif self.late is not None:
                event = self.late.event(fmt.name)
            else:
                event = b"" if self.inner_started else fmt.error_bytes(formats.SSE, *_NO_ANSWER)
            await self._finish_own(event)
