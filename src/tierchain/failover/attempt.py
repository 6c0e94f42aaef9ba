"""One attempt of Failover: its call of the inner app (:func:`call_inner`, a hedge's
too) and its ``send`` (:class:`Responder`).

The responder feeds the attempt's observer, holds ``http.response.start`` until the
answer is worth sending (a first data event, a whole answer), commits it to the caller,
settles the attempt once the inner app returned (:meth:`Responder.conclude`), and, from
the commit on, watches for a caller that stops reading (``send_timeout``). See
docs/failover.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, Protocol

from opentelemetry.trace import INVALID_SPAN

from .._disconnect import DisconnectGuard, Replay
from .._responses import (
    caller_cut,
    error_detail,
    retry_after,
)
from .._runtime import clock, deadlines
from .._runtime.deadlines import EARLY
from .._types import ASGIApp, Headers, Message, Send
from ..admission import Admission
from ..errors import (
    AttemptError,
    BackendUnavailable,
    CallerStalled,
    RetryableStatus,
    StreamError,
)
from ..observer import Observer, nothing_sent
from ..prefill import Prefills
from ..request import (
    SCOPE_KEY,
    TRAIL_HEADER,
    Attempt,
    TierRequest,
    format_trail,
)
from ..telemetry import (
    ATTR_OUTCOME,
    ATTR_REGIME,
    attempt_metrics,
    log_event,
)
from ..waiting import WaitingRoom
from ..wire import context_exceeded
from .call import attempt_span, current, own_abort
from .continuation import continue_stream
from .plan import Fault, failed, record
from .route import ScopeCopy

__all__ = [
    "BACKEND_HEADER",
    "Claim",
    "Owner",
    "Responder",
    "call_inner",
]

_NOT_FOUND = 404  # a routed path the backend does not serve: its fault, the chain advances
BACKEND_HEADER = b"x-tierchain-backend"
_OWN_HEADERS = b"x-tierchain-"  # the gateway's own response headers' prefix
_COMMENT_LIMIT = 64 * 1024  # comment bytes held before the first data event
REFUSAL_LIMIT = 64 * 1024  # bytes of a retryable answer's body kept for its message


class Owner(Protocol):
    """What an attempt (and a hedge's) needs of the Failover that runs it."""

    app: ASGIApp
    retry_statuses: frozenset[int]
    hold_limit: int
    send_timeout: float | None
    admission: Admission
    waiting: WaitingRoom | None
    continuable: dict[str, int]
    prefills: Prefills

    def _begin(
        self, req: TierRequest, guard: DisconnectGuard, send: Send, attempt: Attempt
    ) -> Responder: ...

    async def _give_back(self, lease: Any) -> None: ...


class Claim(Protocol):
    """What a responder needs of the race its attempt is in (``hedging.Race``, which
    runs its hedge with this module's :func:`call_inner`)."""

    def claim(self, responder: Responder) -> bool: ...


async def call_inner(
    owner: Owner,
    req: TierRequest,
    responder: Responder,
    guard: DisconnectGuard,
    copies: ScopeCopy,
) -> BaseException | None:
    """One call of the inner app for ``responder``'s attempt, Failover's or a hedge's: a
    continuation's request asked for, the backend's in-flight lease taken, the app called
    in the scope (a copy after the first attempt) with the body replayed and the attempt's
    span current. Returns what the attempt ended with (None: nothing against it); a
    cancellation that is not the attempt's own abort goes on."""
    attempt = responder.attempt
    try:
        if req.continuation is not None:
            await responder.prepare()  # its request, asked for now
        backend = attempt.backend
        if backend.max_in_flight is not None:
            responder.lease = await owner.admission.enter(backend, last=attempt.is_last)
            waiting = owner.waiting
            if waiting is not None and waiting.waiting(req.route or ""):
                waiting.notify()  # the room this took is counted now
        scope = copies.next()
        scope[SCOPE_KEY] = req  # (a hedge's own request; Failover's is there already)
        # The attempt's span is current inside, so that the Forwarder (or the host's own
        # client instrumentation) sends its trace context upstream.
        inner = owner.app(scope, Replay(req.body or b"", guard), responder.send)
        span = responder.span
        if span is INVALID_SPAN:
            await inner
        else:
            with current(span):
                await inner
    except asyncio.CancelledError:
        if not own_abort(req):
            raise
        return req.attempt_error
    except Exception as exc:
        return exc
    if req.aborted:
        own_abort(req)  # the app swallowed our cancellation and returned
    return req.attempt_error or responder.failure()


class Responder:
    """One attempt's ``send``: feeds its observer, holds the start until it is worth sending."""

    __slots__ = (
        "_caller_watch",
        "_ended",
        "_failover",
        "_guard",
        "_held",
        "_held_size",
        "_pass",
        "_send",
        "_task",
        "attempt",
        "caller_cut",
        "committed",
        "fault",
        "kept",
        "lease",
        "observer",
        "outcome",
        "race",
        "refusal",
        "req",
        "span",
        "start",
    )

    def __init__(
        self, owner: Owner, req: TierRequest, attempt: Attempt, send: Send, guard: DisconnectGuard
    ) -> None:
        """``attempt`` of ``req``, run by ``owner``; ``send`` is the caller's, ``guard`` the
        request's disconnect guard."""
        self._failover = owner
        self.req = req
        self.attempt = attempt
        # The attempt's one observer, on the request for every other layer to read.
        backend = attempt.backend
        # (started, stream_end, wire: positional, as a class called with keywords builds a
        # dict of them and unpacks it again)
        self.observer = req.observer = Observer(
            attempt.started, backend.stream_end, backend.wire_format or req.wire
        )
        self.span = attempt_span(req, attempt)
        if attempt.metrics is None:
            attempt.metrics = attempt_metrics(attempt.route or "", backend.name)
        self.lease: Any = None  # an in-flight lease at the backend, while held
        self._send = send
        self._pass = send  # a committed stream's mid-stream chunks (see _commit)
        self._guard = guard
        self.start: Message | None = None
        self.committed = False
        self.outcome = "ok"
        self.fault: Fault | None = None  # what a failure tells the next step (plan.failed)
        self.refusal: list[bytes] | None = None  # a retryable answer's body, being kept
        self._held: list[bytes] | None = None  # made when something is held
        self._held_size = 0
        self._caller_watch: deadlines.Deadline | None = None  # send_timeout, from commit
        self._task: asyncio.Task[Any] | None = None  # the request's task, for the cut
        self.caller_cut = False  # the watch cut the caller (its cancellation is ours)
        self._ended = False
        # The committed events, by reference, while a continuation could follow a break
        # (see continuation.continue_stream): parsed only then.
        self.kept: list[bytes] | None = None
        self.race: Claim | None = None  # [hedge] the race this attempt is in, if any

    @property
    def guard(self) -> DisconnectGuard:
        """The request's disconnect guard (a hedge's attempt is called with the same)."""
        return self._guard

    @property
    def caller_send(self) -> Send:
        """The caller's ``send`` (a hedge's responder writes to the same caller)."""
        return self._send

    async def prepare(self) -> None:
        """Before the inner app is called: nothing to ask (a continuation asks for its
        request here: :meth:`~tierchain.failover.continuing.Continuing.prepare`)."""

    def send(self, message: Message) -> Awaitable[None]:
        """The inner app's send. A committed stream's events go straight on."""
        if self.committed and message["type"] == "http.response.body":
            observer = self.observer
            chunk: bytes = message.get("body", b"")
            more = message.get("more_body", False)
            if (
                observer.sse
                and chunk[:5] == b"data:"
                and chunk[-1] == 10  # "\n\n" (indexes: cheaper than a slice or endswith)
                and chunk[-2] == 10
                and not observer.pending
                and not observer.pending_cr
                and observer.first_data_at is not None
            ):
                # The usual chunk: whole data events, nothing held, passed as is. This is
                # Observer.body's first case, inline (a frame less per streamed chunk).
                observer.last_event_at = clock.now()
                observer.data_events += 1
                observer._previous, observer._last = observer._last, chunk
                if more:
                    kept = self.kept
                    if kept is not None:
                        kept.append(chunk)
                    # (Read, then called: a call of a slot's bound method straight off
                    # ``self`` is one the interpreter cannot specialise.)
                    passing = self._pass
                    return passing(message)
                out = chunk
            elif observer.sse or observer.ndjson:
                events = self._observed(chunk)
                if events is None:
                    return nothing_sent()
                out = events
                if more:
                    if not out:
                        return nothing_sent()  # part of an event: held until it is whole
                    if self.kept is not None:
                        self.kept.append(out)
                    if out is chunk:
                        return self._send(message)  # whole events as they came: passed as is
                    return self._send(
                        {"type": "http.response.body", "body": out, "more_body": True}
                    )
            else:
                observer.body(chunk)
                if not more:
                    observer.end()
                    self._guard.done = True
                return self._send(message)
            observer.end()
            if observer.complete:
                self._guard.done = True
                if out is chunk:
                    send = self._send  # (read, then called: as above)
                    return send(message)  # the last events as they came
                return self._send({"type": "http.response.body", "body": out, "more_body": False})
            # Truncated: the caller gets the events so far, then (from Failover, once
            # the app returns) an error event, never a silently short answer.
            if not out:
                return nothing_sent()
            if self.kept is not None:
                self.kept.append(out)
            return self._send({"type": "http.response.body", "body": out, "more_body": True})
        if message["type"] == "http.response.start" and not self.req.aborted:
            self._on_start(message)  # nothing to send yet: no coroutine of ours
            return nothing_sent()
        return self._before_commit(message)

    def _on_start(self, message: Message) -> None:
        status = int(message["status"])
        headers = list(message.get("headers", ()))
        self.observer.start(status, headers)
        if self._refuses(status):
            self.refusal = []  # kept for its message, never sent
            return
        self.start = {**message, "headers": headers}
        self.outcome = "ok" if status < 400 else f"http_{status}"

    def _refuses(self, status: int) -> bool:
        """True when an answer with ``status`` is a refusal: its body kept for its message,
        nothing of it sent, and the chain advances (a retryable status, a 404)."""
        return status in self._failover.retry_statuses or status == _NOT_FOUND

    def _other(self, message: Message) -> Awaitable[None]:
        """A message that is neither the head nor the body (``http.response.trailers``):
        passed on as it is once committed (or when no head was held)."""
        if self.committed or self.start is None:
            return self._send(message)
        return nothing_sent()

    def _unsent(self, message: Message) -> Awaitable[None] | None:
        """The message's end when it is not a body to pass on, else None: nothing sent
        once the attempt is on its way out, the head held (:meth:`_on_start`), another
        message's own way (:meth:`_other`), a refusal's body kept for its message."""
        if self.req.aborted:
            return nothing_sent()  # on its way out: nothing more goes to the caller
        kind = message["type"]
        if kind == "http.response.start":
            self._on_start(message)
            return nothing_sent()
        if kind != "http.response.body":
            return self._other(message)
        refusal = self.refusal
        if refusal is not None:
            chunk: bytes = message.get("body", b"")
            if chunk and sum(map(len, refusal)) < REFUSAL_LIMIT:
                refusal.append(chunk)
            if not message.get("more_body", False):
                self.observer.end()
            return nothing_sent()
        if self.start is None:
            raise RuntimeError("the inner app sent a body before http.response.start")
        return None

    def _before_commit(self, message: Message) -> Awaitable[None]:
        # Not a coroutine: each case has at most one send to wait for, returned as is
        # (the first chunk's commit costs no coroutine of this method's own).
        unsent = self._unsent(message)
        if unsent is not None:
            return unsent
        observer = self.observer
        chunk: bytes = message.get("body", b"")
        more = bool(message.get("more_body", False))
        if self.committed:
            return self.send(message)  # a trailer-less body after commit: the usual path
        if observer.sse or observer.ndjson:
            out = self._observed(chunk)
            if out is None:
                return nothing_sent()
            if observer.first_data_at is None:
                # Comments and pings before the first data event: held with it.
                if out:
                    if self._held_size + len(out) > _COMMENT_LIMIT and not observer.opened:
                        self._held = None  # comments only, none of them progress
                        self._held_size = 0
                    self._hold(out)
                if not more:
                    observer.end()  # no data at all: the attempt fails (no_data)
                return nothing_sent()
            if not more:
                observer.end()
                if not observer.complete:
                    return nothing_sent()  # whole stream, nothing sent, but truncated: fail over
            return self.commit(self.held_body() + out if self._held else out, more_body=more)
        observer.body(chunk)
        if not more:
            observer.end()
            self._hold(chunk)  # whole: committed by Failover once the app returns
            return nothing_sent()
        self._hold(chunk)
        if self._held_size > self._failover.hold_limit:
            return self.commit_held(more_body=True)  # too large to hold: stream on
        return nothing_sent()

    def _observed(self, chunk: bytes) -> bytes | None:
        """The whole events of a stream's ``chunk`` the observer releases (b"": none yet),
        or None for a malformed stream: the attempt is aborted with the observer's error."""
        try:
            return self.observer.body(chunk)
        except StreamError as exc:
            self.req.abort(exc)
            return None

    def _hold(self, chunk: bytes) -> None:
        if chunk:
            if self._held is None:
                self._held = [chunk]
            else:
                self._held.append(chunk)
            self._held_size += len(chunk)

    def held_body(self) -> bytes:
        """Everything held so far, released."""
        held = self._held
        if held is None:
            return b""
        self._held = None
        self._held_size = 0
        return held[0] if len(held) == 1 else b"".join(held)

    def failure(self) -> AttemptError | None:
        """Why the attempt failed, judged once the app returned (None: it answered)."""
        observer = self.observer
        if self.refusal is not None:
            assert observer.status is not None
            return RetryableStatus(
                observer.status,
                retry_after=retry_after(observer.headers),
                detail=error_detail(b"".join(self.refusal)),
            )
        if self.start is None:
            return AttemptError("the handler returned without answering", reason="no_response")
        if self.committed:
            if observer.ended and observer.complete:
                return None
            if observer.framed and observer.ended:
                return StreamError("the stream ended without its terminator", reason="truncated")
            return BackendUnavailable("the response ended before it was whole", reason="truncated")
        if observer.framed:
            if observer.first_data_at is None:
                return StreamError("the event stream carried no data event", reason="no_data")
            return StreamError("the stream ended without its terminator", reason="truncated")
        if not observer.ended:
            return BackendUnavailable(
                "the handler returned before the response was whole", reason="truncated"
            )
        if (
            observer.status == 400
            and not self.attempt.is_last
            and self._held
            and context_exceeded(b"".join(self._held))
        ):
            # The request does not fit this tier's context window: a later tier may
            # have a larger one. Not the backend's failure (its breaker sees a 400).
            return AttemptError(
                "the request exceeds the backend's context window", reason="context_exceeded"
            )
        return None

    async def conclude(self, error: BaseException | None) -> bool:
        """Settle the attempt once the app has returned (or failed): commit a held
        answer, end a broken one, or count the failure. True when the caller has
        its answer (the chain stops); False to fail over."""
        req, attempt = self.req, self.attempt
        if isinstance(error, CallerStalled):
            await self.caller_stalled(error)  # raises: the server drops the connection
        if error is None:
            if not self.committed:
                await self.commit_held(more_body=False)
            record(req, attempt, self.outcome)
            return True
        if self.committed and self.observer.reached_end():
            # Every event and the terminator reached the caller; only the transport
            # broke after: a whole answer, ended cleanly.
            self.observer.end()
            self._guard.done = True
            await self._to_caller({"type": "http.response.body", "body": b"", "more_body": False})
            record(req, attempt, self.outcome)
            return True
        outcome = self.outcome = error.reason if isinstance(error, AttemptError) else "error"
        if self.committed:
            # False: the stream goes on from the next tier (a continuation).
            return not await self.fail_after_commit(error, outcome)
        if not isinstance(error, AttemptError):
            log_event(
                "dispatch.attempt_error",
                level=40,
                route=attempt.route,
                backend=attempt.backend.name,
                error=repr(error),
            )
        self.fault = failed(req, attempt, error, outcome)
        return False

    def end(self) -> Any:
        """The attempt is over: end its span. Returns its in-flight lease to give back."""
        self._ended = True
        if self._caller_watch is not None:
            deadlines.cancel(self._caller_watch)
            self._caller_watch = None
        span = self.span
        if span is not INVALID_SPAN:  # (no SDK: nothing to record)
            span.set_attribute(ATTR_OUTCOME, self.outcome)
            if self.attempt.backend.regime is None and self.outcome == "saturated":
                span.set_attribute(ATTR_REGIME, "saturated")
            span.end()
        lease, self.lease = self.lease, None
        return lease

    async def commit_held(self, *, more_body: bool) -> None:
        """Commit what is held, in the pieces it came in: never joined, each let go once
        sent, so a held answer costs about its own size (a join cost twice that, and the
        server's copy of one large body a third time)."""
        if self.race is not None and not self.race.claim(self):  # [hedge] lost the race
            return
        held, size = self._held, self._held_size
        self._held = None
        self._held_size = 0
        if held is None or len(held) == 1:
            return await self.commit(held[0] if held else b"", more_body=more_body)
        last = len(held) - 1
        await self.commit(held[0], more_body=True, length=None if more_body else size)
        held[0] = b""
        for i in range(1, last + 1):
            chunk, held[i] = held[i], b""
            if i == last and not more_body:
                self._guard.done = True
            message = {
                "type": "http.response.body",
                "body": chunk,
                "more_body": more_body or i < last,
            }
            await self._to_caller(message)

    async def commit(self, chunk: bytes, *, more_body: bool, length: int | None = None) -> None:
        """Send the held start and ``chunk``: the point of no return.

        ``length``: the whole body's, when ``chunk`` is its first piece of several."""
        assert self.start is not None
        if self.race is not None and not self.race.claim(self):  # [hedge] lost the race
            return
        req, attempt, observer = self.req, self.attempt, self.observer
        self.committed = True
        req.committed = True
        now = clock.now()
        metrics = attempt.metrics
        assert metrics is not None  # (resolved in __init__)
        metrics.first_chunk.observe(now - attempt.started)
        metrics.first_token.observe(now - attempt.started)
        # One pass over the headers: the gateway's own x-tierchain-* headers win (an
        # upstream's never reach the caller), and the content-length goes where the length
        # may change (a partial event dropped, an error event added, state lines put in
        # front: the server then frames the body) or where this layer sets it.
        unsized = observer.sse or observer.ndjson or (more_body and length is None)
        status = observer.status
        # (Loops, not list comprehensions: a comprehension is a frame of its own.)
        headers: Headers = []
        keep = headers.append
        if unsized or (status is not None and status >= 200 and status not in (204, 304)):
            for k, v in self.start["headers"]:
                name = k.lower()
                if name != b"content-length" and not name.startswith(_OWN_HEADERS):
                    keep((k, v))
            if not unsized:
                keep((b"content-length", str(len(chunk) if length is None else length).encode()))
        else:
            for k, v in self.start["headers"]:
                if not k.lower().startswith(_OWN_HEADERS):
                    keep((k, v))
        backend = attempt.backend
        name = backend.name
        shown = name if backend.pool is None else f"{name};pool={backend.pool}"
        if req.attempts:
            trail = format_trail(req.attempts, (shown, self.outcome))
        else:  # the usual case, the first tier answered: format_trail's first case
            trail = f"{shown};outcome={self.outcome}".encode()
        if backend.pool is None:
            req.emit("generating", backend=name)
        else:
            req.emit("generating", backend=name, pool=backend.pool)
        keep((TRAIL_HEADER, trail))
        keep((BACKEND_HEADER, name.encode()))
        self.start["headers"] = headers
        if (
            more_body
            and attempt.n < attempt.of
            and (observer.sse or observer.ndjson)
            and self._failover.continuable.get(attempt.route or "")
        ):
            self.kept = [chunk]
            req.continuable = True
        self._watch_caller()
        # The start and the first chunk, as two of _to_caller's sends in one block (the
        # caller's marks: out from each send's start, back after the last). A going stream's
        # first chunk goes as the next go (``_pass``: past a layer that only notes the start).
        req.caller_blocked_since = now
        send, passing = self._send, req.body_pass
        try:
            if passing is not None and passing.inward is send:
                passing.started = True  # (its note, made here)
                self._pass = passing.passes_to
                await passing.passes_to(self.start)
            else:
                await send(self.start)
            if not more_body:
                self._guard.done = True
            req.caller_unblocked_at = req.caller_blocked_since = clock.now()
            first = self._pass if more_body else send
            await first({"type": "http.response.body", "body": chunk, "more_body": more_body})
        except asyncio.CancelledError:
            self._stalled()
            raise
        req.caller_blocked_since = None
        req.caller_unblocked_at = clock.now()

    async def fail_after_commit(self, exc: BaseException, outcome: str) -> bool:
        """End a committed response after its attempt failed mid-way, or (True) leave it
        open for a continuation on the next tier."""
        attempt = self.attempt
        record(self.req, attempt, outcome)
        log_event(
            "dispatch.stream_failed",
            level=30,
            route=attempt.route,
            backend=attempt.backend.name,
            outcome=outcome,
            error=repr(exc),
        )
        error = self.observer.error_bytes(
            f"backend {attempt.backend.name!r} failed mid-stream ({outcome})",
            "upstream_error",
            outcome,
        )
        if error is None:
            raise exc  # not a stream: let the server abort the connection
        self.observer.drop_pending()  # a partial event never reaches the caller
        self._guard.done = True
        # The backend is done with: its place goes back before the caller is written
        # to, and that write is bounded by send_timeout like every other.
        lease, self.lease = self.lease, None
        if lease is not None:
            await self._failover.admission.leave(lease)
        kept, self.kept = self.kept, None
        observer = self.observer
        if kept is not None:
            continuable = self._failover.continuable
            shown = continue_stream(
                continuable, self.req, attempt, observer.wire, observer.ndjson, kept, error
            )
            if shown is None:
                self._guard.done = False  # the stream goes on: the caller is watched again
                return True
            error = shown  # the break, or the answer's end at the caller's token limit
        await self._to_caller({"type": "http.response.body", "body": error, "more_body": False})
        return False

    async def caller_stalled(self, error: CallerStalled) -> None:
        """The caller stopped reading: record it (never the backend's failure), give
        the lease back, and raise, so the server drops the connection. Nothing more is
        written: it would wait on the same caller."""
        self.outcome = error.reason
        record(self.req, self.attempt, error.reason)
        lease, self.lease = self.lease, None
        if lease is not None:
            await self._failover.admission.leave(lease)
        raise error

    # -- the caller's side: send_timeout -------------------------------------------

    async def _to_caller(self, message: Message) -> None:
        """One of Failover's own sends to the caller, marked as out while it is
        (``TierRequest.caller_blocked_since``); the cut turns into CallerStalled."""
        req = self.req
        req.caller_blocked_since = clock.now()
        try:
            await self._send(message)
        except asyncio.CancelledError:
            self._stalled()
            raise
        req.caller_blocked_since = None
        req.caller_unblocked_at = clock.now()

    def _stalled(self) -> None:
        """In ``except CancelledError`` around a send to the caller: raise
        :class:`CallerStalled` when it was the watch's cut (else the caller re-raises)."""
        req = self.req
        if self.caller_cut and own_abort(req):
            error = req.attempt_error
            assert isinstance(error, CallerStalled)
            raise error from None

    def _watch_caller(self) -> None:
        """From the commit on: look every ``send_timeout`` for a send out that long.

        A request younger than the disconnect guard's ``WATCH_AFTER`` (20 ms) starts
        its watch then, from the guard's own queue: most answers are over by then and
        never pay for a deadline (a cut comes at most that much later)."""
        if self._failover.send_timeout is None or self._caller_watch is not None:
            return
        guard = self._guard
        if guard.young:
            guard.then.append(self._arm_caller_watch)
        else:
            self._arm_caller_watch()

    def _arm_caller_watch(self) -> None:
        timeout = self._failover.send_timeout
        if timeout is None or self._caller_watch is not None or self._ended:
            return
        self._task = self._guard.task
        self._caller_watch = deadlines.schedule(timeout, self._caller_due)

    def _caller_due(self) -> None:
        """The watch's call: cut the caller if a send has been out for send_timeout,
        else look again when the send out now would reach it."""
        self._caller_watch = None
        timeout = self._failover.send_timeout
        assert timeout is not None
        req = self.req
        since = req.caller_blocked_since
        if since is None:
            self._caller_watch = deadlines.schedule(timeout, self._caller_due)
            return
        now = clock.now()
        left = since + timeout - now
        if left > EARLY:  # (the scheduler may call this that early)
            self._caller_watch = deadlines.schedule(left, self._caller_due, fixed=False)
            return
        task = self._task
        if task is None or task.done() or req.aborted:
            return  # on its way out already
        self.caller_cut = True
        req.attempt_error = caller_cut(req, "relay")
        req.aborted = True
        assert req.interruption is not None  # armed on entry
        req.interruption.interrupt("tierchain: caller_stalled")
