"""Breaker: skip a backend that keeps failing or saturating, and recover with one probe.

Per (route, backend) a breaker is closed, open or half-open, with two ledgers
that count and cool down separately: *failures* (refused, reset, connect
timeout, broken stream, 5xx, 429) and *saturations* (the watchdog's
``BackendSaturated``). A busy backend is not a broken one: by default two
consecutive saturations open it for 15 minutes, five consecutive failures for
``probe_every`` (2 s), then, while its probes keep failing, one ``probe_every`` longer
each time (4, 6, 8 ... s) up to ``failure_cooldown`` (30 s): Envoy's outlier ejection
backoff (base ejection time times the ejections in a row, capped). One good attempt
clears both counts. A second try of the same backend in one request (Failover's
``retries``) that fails before any data is not a second failure: the first was counted.

A breaker re-opened because its half-open probe saturated cools down for
``saturation_backoff`` seconds (30 s), doubling with each further re-open up
to ``saturation_cooldown``: one slow request after a hiccup never costs the
whole cooldown. A breaker open for saturation half-opens as soon as the gateway finds the
backend rested by itself (:mod:`tierchain.rested`: its polled status idle, or a one-token
check of its own answered in time), without waiting out its cooldown.

Inside a :class:`~tierchain.Failover` the Breaker runs once per attempt. While
open it raises :class:`~tierchain.errors.BackendSkipped` without calling the
inner app, and Failover advances at once. When the cooldown ends, exactly one
request at a time goes through as the probe; everyone else skips the backend
immediately. The probe's success closes the breaker, its failure re-opens it.

Alone (no Failover in front) it guards one backend and answers 503 with
``Retry-After`` while open.

Each attempt's outcome is settled exactly once, when the attempt ends, from the
attempt's :class:`~tierchain.observer.Observer` (Failover's; alone, the
Breaker's own):

- success: a status below 400 and a whole answer (an event stream that reached
  its terminator);
- failure: a 5xx or 429 status, ``BackendUnavailable``, a stream that broke,
  was truncated, stalled or was malformed after its first data event, an event
  stream with no data event, or any other exception;
- saturation: ``BackendSaturated``;
- neutral (counts nothing, clears nothing, frees a probe slot): a 4xx other
  than 429, a cancelled attempt (the caller left), a spent budget, a backend
  skipped as busy (``BackendBusy``: busy is not a failure), and a
  ``BackendUnavailable`` the gateway caused itself (``gateway_fault``: a wait
  for a pooled connection, a connect timeout while its event loop ran late).

A failure of a stream that had already reached the caller (it broke, was cut
short or stalled mid-answer) is a *mid-stream death*: it costs the caller a
whole turn, so it counts as a failure and, on a ledger of its own, opens the
breaker after ``stream_failure_threshold`` (2) in a row, where refused
connections (milliseconds each) take ``failure_threshold`` (5).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable
from datetime import timedelta
from typing import Any, Literal

from ._checks import count, duration
from ._responses import retry_after, send_json_error
from ._runtime import clock
from ._types import ASGIApp, Message, Receive, Scope, Send
from .backend import Backend
from .errors import (
    AttemptError,
    BackendBusy,
    BackendSaturated,
    BackendSkipped,
    BackendUnavailable,
    CallerStalled,
    RetryableStatus,
    TierchainError,
)
from .observer import Observer
from .probes import auto_reader
from .request import UNROUTED_KEY, TierRequest
from .rested import RestChecks
from .status import StatusBoard, board_within, idle
from .store import (
    BreakerChange,
    BreakerPolicy,
    MemoryStore,
    Outcome,
    Store,
    Ticket,
)
from .telemetry import (
    BACKEND_SKIPPED,
    BREAKER_RECOVERY_PROBES,
    BREAKER_STATE,
    BREAKER_TRANSITIONS,
    log_event,
)
from .wire import recognise

__all__ = ["Breaker"]

_STATE_VALUE = {"closed": 0, "half_open": 1, "open": 2}
_TRANSITION_EVENT = {
    "open": "breaker.opened",
    "half_open": "breaker.half_open",
    "closed": "breaker.closed",
}
_STORE_WARN_EVERY = 60.0
_ADMIT = Ticket(True, "closed", clean=True)


class Breaker:
    """Skip a (route, backend) whose breaker is open; record every attempt's outcome.

    Each backend has two ledgers, of failures and of saturations: a run of either opens
    its breaker, and a recovery probe that succeeds closes it again. ``store`` holds the
    ledgers: pass one :class:`~tierchain.RedisStore` to every replica to share them.

    Options: [Breaker options](breaker.md#options).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: Store | None = None,
        failure_threshold: int = 5,
        failure_cooldown: float | timedelta = 30.0,
        stream_failure_threshold: int = 2,
        probe_every: float | timedelta = 2.0,
        saturation_threshold: int = 2,
        saturation_cooldown: float | timedelta = 900.0,
        saturation_backoff: float | timedelta = 30.0,
        retry_after_cap: float | timedelta = 900.0,
        probe_lease: float | timedelta = 300.0,
        when_all_open: Literal["reject", "try_soonest"] = "reject",
        backend: str | Backend = "default",
        status_board: StatusBoard | None = None,
        rest_check_every: float | timedelta = 5.0,
        rest_check_timeout: float | timedelta = 2.0,
    ) -> None:
        failure_threshold = count("failure_threshold", failure_threshold)
        stream_failure_threshold = count("stream_failure_threshold", stream_failure_threshold)
        probe_every = duration("probe_every", probe_every, allow_zero=True)
        saturation_threshold = count("saturation_threshold", saturation_threshold)
        failure_cooldown = duration("failure_cooldown", failure_cooldown, allow_zero=True)
        saturation_cooldown = duration("saturation_cooldown", saturation_cooldown, allow_zero=True)
        saturation_backoff = duration("saturation_backoff", saturation_backoff, allow_zero=True)
        retry_after_cap = duration("retry_after_cap", retry_after_cap, allow_zero=True)
        probe_lease = duration("probe_lease", probe_lease)
        rest_check_every = duration("rest_check_every", rest_check_every, allow_zero=True)
        rest_check_timeout = duration("rest_check_timeout", rest_check_timeout)
        if when_all_open not in ("reject", "try_soonest"):
            raise ValueError(
                f"when_all_open must be 'reject' or 'try_soonest', got {when_all_open!r}"
            )
        self.app = app
        self.store: Store = store if store is not None else MemoryStore()
        # This process's own store (not a subclass): asked without a coroutine.
        self._in_memory = self.store if type(self.store) is MemoryStore else None
        self.policy = BreakerPolicy(
            failure_threshold=failure_threshold,
            failure_cooldown=failure_cooldown,
            saturation_threshold=saturation_threshold,
            saturation_cooldown=saturation_cooldown,
            retry_after_cap=retry_after_cap,
            probe_lease=probe_lease,
            saturation_backoff=saturation_backoff,
            stream_failure_threshold=stream_failure_threshold,
            probe_every=probe_every,
        )
        self.when_all_open = when_all_open
        self.backend = backend.name if isinstance(backend, Backend) else str(backend)
        self._alone_backend = backend if isinstance(backend, Backend) else None
        if status_board is not None and not isinstance(status_board, StatusBoard):
            raise ValueError(
                f"status_board must be a tierchain.status.StatusBoard, got {status_board!r}"
            )
        # The board of the watchdog this breaker wraps (found once, here), or the one given.
        self.status_board = status_board if status_board is not None else board_within(app)
        # The gateway's own re-checks of a backend opened for saturation (rested.py).
        self.rest = RestChecks(
            self.store,
            self.policy,
            every=rest_check_every,
            timeout=rest_check_timeout,
            board=self.status_board,
            observe=self._observe_ticket,
        )
        self._gauges: dict[tuple[str, str], tuple[Any, int]] = {}
        self._store_warned = -math.inf

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or UNROUTED_KEY in scope:
            if scope["type"] == "lifespan":
                return await self.app(scope, receive, self._lifespan_send(send))
            return await self.app(scope, receive, send)
        req = TierRequest.find(scope)
        attempt = req.attempt if req is not None and req.in_chain else None
        if req is None or attempt is None:
            return await self._alone(scope, receive, send, req)
        route = req.route or attempt.route or ""
        name = attempt.backend.name
        if self.when_all_open == "try_soonest":
            req.try_soonest = True
        store = self._in_memory
        if store is not None:
            # This process's own store: no coroutine, no wait (and no frame of ours).
            try:
                ticket = store.breaker_acquire_now(route, name, self.policy, force=attempt.force)
            except Exception as exc:  # a store must never fail a request
                self._store_failed(exc)
                ticket = _ADMIT
            else:
                cached = self._gauges.get((route, name))
                if (
                    ticket.transitions
                    or cached is None
                    or cached[1] != _STATE_VALUE.get(ticket.state, 0)
                ):
                    self._observe(route, name, ticket.state, ticket.transitions, None)
                # (Otherwise nothing to show: no transition, the gauge says this state.)
        else:
            ticket = await self._acquire(route, name, attempt.force)
        if (
            not ticket.admitted
            and ticket.state == "open"
            and _reports_idle(self.status_board, attempt.backend)
        ):
            ticket = await self._acquire(route, name, attempt.force, wake=True)
        if not ticket.admitted and ticket.state == "half_open" and attempt.waited:
            # This caller waited out the backend's own Retry-After: that time has come,
            # and the probe another caller holds does not turn it away (it gets its retry).
            ticket = await self._acquire(route, name, True)
        if ticket.probe:
            _recovery_probe(route, name)
        if not ticket.admitted:
            BACKEND_SKIPPED.labels(route, name).inc()
            if ticket.reason == "saturation":  # (a check runs: this starts one if none does)
                self.rest.watch(route, attempt.backend, req.wire)
            raise BackendSkipped(
                _skip_message(name, ticket), retry_in=ticket.retry_in, why=ticket.reason
            )
        # The attempt, in this frame (a waiting stream holds one less): the guard
        # reads Failover's observer and settles the outcome once it ends.
        guard = _Guard(self, route, name, ticket, req)
        try:
            await self.app(scope, receive, send)
        except BaseException as exc:
            await guard.failed(exc)
            raise
        recording = guard.settle()
        if recording is not None:
            await recording

    async def _alone(
        self, scope: Scope, receive: Receive, send: Send, req: TierRequest | None
    ) -> None:
        """No Failover: guard the one backend, answering 503 fast while open."""
        route = (req.route if req is not None else None) or ""
        name = self.backend
        ticket = await self._acquire(route, name, False)
        if ticket.probe:
            _recovery_probe(route, name)
        if not ticket.admitted:
            BACKEND_SKIPPED.labels(route, name).inc()
            if ticket.reason == "saturation" and self._alone_backend is not None:
                self.rest.watch(route, self._alone_backend, req.wire if req else None)
            await self._answer_open(send, req, name, ticket)
            return
        guard = _Guard(self, route, name, ticket, req)
        guard.downstream = send  # the send the own observer feeds
        if guard.own:  # judged by the request's own wire format (a path check)
            guard.observer.wire = recognise(scope.get("path", ""))
        try:
            await self.app(scope, receive, guard.send if guard.own else send)
        except BaseException as exc:
            await guard.failed(exc)
            if not isinstance(exc, AttemptError) or guard.observer.status is not None:
                raise  # not the backend's, or the response has started: the server ends it
            saturated = isinstance(exc, BackendSaturated | BackendSkipped)
            await send_json_error(
                send,
                503 if saturated else 502,
                f"backend {name!r}: {exc}",
                "backend_saturated" if saturated else "upstream_error",
                exc.reason,
            )
            return
        recording = guard.settle()
        if recording is not None:
            await recording

    async def _answer_open(
        self, send: Send, req: TierRequest | None, name: str, ticket: Ticket
    ) -> None:
        retry_in = ticket.retry_in
        shown = None if retry_in is None else round(retry_in, 1)
        if req is not None:
            req.emit("backend_skipped", backend=name, retry_in_s=shown, failing_over=False)
        retry = max(1, math.ceil(retry_in or 1.0))
        await send_json_error(
            send,
            503,
            f"backend {name!r} is cooling down; retry in {retry}s",
            "backend_open",
            "service_unavailable",
            headers=[(b"retry-after", str(retry).encode())],
            backends=[{"backend": name, "state": ticket.state, "retry_in_s": shown}],
        )

    def _lifespan_send(self, send: Send) -> Send:
        async def lifespan_send(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await self.rest.aclose()  # no re-check outlives the gateway
            await send(message)

        return lifespan_send

    async def aclose(self) -> None:
        """Stop the re-checks of saturated backends (done on lifespan shutdown; call it
        yourself where the framework gives middleware no lifespan)."""
        await self.rest.aclose()

    def _observe_ticket(self, route: str, name: str, ticket: Ticket) -> None:
        self._observe(route, name, ticket.state, ticket.transitions, None)

    # -- the store, guarded -------------------------------------------------

    async def _acquire(self, route: str, name: str, force: bool, wake: bool = False) -> Ticket:
        try:
            if wake:
                ticket = await self.store.breaker_acquire(
                    route, name, self.policy, force=force, wake=True
                )
            else:
                ticket = await self.store.breaker_acquire(route, name, self.policy, force=force)
        except TypeError as exc:
            if wake:  # a custom store without wake: wait out the cooldown
                return await self._acquire(route, name, force)
            self._store_failed(exc)
            return _ADMIT
        except Exception as exc:  # a store must never fail a request
            self._store_failed(exc)
            return _ADMIT
        self._observe(route, name, ticket.state, ticket.transitions, None)
        return ticket

    async def record(
        self,
        route: str,
        name: str,
        ticket: Ticket,
        outcome: Outcome,
        retry_after: float | None = None,
        backend: Backend | None = None,
        wire: str | None = None,
    ) -> None:
        """Apply one attempt's outcome (what :class:`_Guard` calls, exactly once).

        ``backend`` (with the request's ``wire``) is given for a saturation: when it
        opens the breaker, the gateway starts re-checking the backend itself."""
        if _nothing_to_record(ticket, outcome):
            return
        try:
            change = await self.store.breaker_record(
                route,
                name,
                self.policy,
                outcome,
                gen=ticket.gen,
                probe=ticket.probe,
                retry_after=retry_after,
            )
        except Exception as exc:
            self._store_failed(exc)
            return
        self._observe(route, name, change.state, change.transitions, change)
        if backend is not None and change.state == "open" and change.reason == "saturation":
            self.rest.watch(route, backend, wire)

    def _store_failed(self, exc: Exception) -> None:
        now = clock.now()
        if now - self._store_warned >= _STORE_WARN_EVERY:
            self._store_warned = now
            log_event("breaker.store_failed", level=30, error=repr(exc))

    def _observe(
        self,
        route: str,
        name: str,
        state: str,
        transitions: tuple[str, ...],
        change: BreakerChange | None,
    ) -> None:
        key = (route, name)
        value = _STATE_VALUE.get(state, 0)
        cached = self._gauges.get(key)
        if cached is None or cached[1] != value:
            gauge = BREAKER_STATE.labels(route, name) if cached is None else cached[0]
            gauge.set(value)
            self._gauges[key] = (gauge, value)
        for to in transitions:
            BREAKER_TRANSITIONS.labels(route, name, to).inc()
            fields: dict[str, Any] = {"route": route, "backend": name}
            if change is not None:
                fields.update(failures=change.failures, saturations=change.saturations)
                if to == "open":
                    fields.update(reason=change.reason, retry_in_s=_round(change.retry_in))
            log_event(_TRANSITION_EVENT[to], level=30 if to == "open" else 20, **fields)


def _nothing_to_record(ticket: Ticket, outcome: Outcome) -> bool:
    """True when the store need not hear of ``outcome`` (most successes)."""
    if ticket.probe:
        return False  # a probe slot to give back
    if outcome == "neutral":
        return True  # nothing to count
    # Closed with nothing counted: one round trip per request is enough.
    return outcome == "success" and ticket.clean


def _reports_idle(board: StatusBoard | None, backend: Backend) -> bool:
    """True when the backend's polled status (if any) says it is doing nothing."""
    url = backend.status_url
    if url is None or board is None:
        return False
    return idle(board.peek(url, auto_reader))


def _recovery_probe(route: str, name: str) -> None:
    """A breaker not closed let one request through as its recovery probe."""
    BREAKER_RECOVERY_PROBES.labels(route, name).inc()
    log_event("breaker.recovery_probe", route=route, backend=name)


def _mid_stream(req: TierRequest | None, observer: Observer, ticket: Ticket) -> Outcome:
    """A failure's outcome: ``stream_failure`` for a stream that had reached the caller
    (it broke or stalled mid-answer), else ``failure``; ``neutral`` for a second try of
    the same backend in one request that failed before any data (the first try's
    failure was counted: one request's bad luck is one failure, not two), unless it
    holds the probe slot."""
    if req is not None and req.in_chain:
        if req.committed:
            return "stream_failure"
        attempt = req.attempt
        if attempt is not None and attempt.retry and not ticket.probe:
            return "neutral"
        return "failure"
    framed = observer.sse or observer.ndjson
    return "stream_failure" if framed and observer.first_data_at is not None else "failure"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _skip_message(name: str, ticket: Ticket) -> str:
    if ticket.state == "half_open":
        return f"backend {name!r} is half-open and another request is probing it"
    return f"backend {name!r} is open; retry in {_round(ticket.retry_in)}s"


def _classify(exc: BaseException) -> tuple[Outcome, float | None]:
    if isinstance(exc, BackendSaturated):
        return "saturation", None
    if isinstance(exc, RetryableStatus):
        if exc.status >= 500 or exc.status in (429, 404):  # 404: Failover's routed-path fault
            return "failure", exc.retry_after if exc.status in (429, 503) else None
        return "neutral", None
    if isinstance(exc, BackendSkipped | BackendBusy):
        return "neutral", None  # an inner breaker's verdict, or no room: not a failure
    if isinstance(exc, BackendUnavailable) and exc.gateway_fault:
        return "neutral", None  # the gateway's own slowness, not this backend's
    if isinstance(exc, CallerStalled):
        return "neutral", None  # the caller stopped reading: the backend waited on it
    if isinstance(exc, AttemptError):
        return "failure", None
    if isinstance(exc, TierchainError):
        return "neutral", None  # a spent budget is a deadline, not the backend's fault
    if isinstance(exc, Exception):
        return "failure", None
    return "neutral", None  # cancelled: the caller left, or the budget ended the attempt


def _judge(observer: Observer) -> tuple[Outcome, float | None]:
    """The outcome of an attempt that returned, from what its response showed."""
    status = observer.status
    if status is None:
        return "failure", None  # returned without answering
    if status < 400:  # (most attempts)
        return ("success" if observer.verdict() == "ok" else "failure"), None
    if status >= 500 or status == 429:
        hint = retry_after(observer.headers) if status in (429, 503) else None
        return "failure", hint
    return "neutral", None


class _Guard:
    """One admitted attempt: settle its outcome once, when it ends.

    Inside a Failover it reads the attempt's observer and wraps nothing; alone
    it feeds an observer of its own from a ``send`` wrapper.
    """

    __slots__ = ("breaker", "downstream", "name", "observer", "own", "req", "route", "ticket")

    def __init__(
        self, breaker: Breaker, route: str, name: str, ticket: Ticket, req: TierRequest | None
    ) -> None:
        self.breaker = breaker
        self.route = route
        self.name = name
        self.ticket = ticket
        self.req = req
        shared = req.observer if req is not None and req.in_chain else None
        self.own = shared is None
        self.observer = shared if shared is not None else Observer()
        self.downstream: Send | None = None

    async def failed(self, exc: BaseException) -> None:
        """The attempt raised (or was cancelled): record why, once.

        A stream that reached its terminator is a success whatever broke after
        it; one the budget ended while it was stalled (the watchdog left
        ``stalled`` as the attempt's error) is a failure.
        """
        req = self.req
        if self.observer.reached_end():
            await self.breaker.record(self.route, self.name, self.ticket, "success", None)
            return
        cause = (
            req.attempt_error
            if req is not None and (req.aborted or req.cancel_reason is not None)
            else None
        )
        outcome, retry_after = _classify(cause or exc)
        if outcome == "failure":
            outcome = _mid_stream(req, self.observer, self.ticket)
        if outcome == "saturation":
            await self._saturated()
            return
        await self.breaker.record(self.route, self.name, self.ticket, outcome, retry_after)

    def settle(self) -> Awaitable[None] | None:
        """The attempt returned: record what its response showed, once (the
        recording to await, or None when there is nothing to record)."""
        left = self.req.attempt_error if self.req is not None else None
        if left is not None and self.observer.reached_end():
            left = None  # the terminator arrived: a transport glitch after it is no failure
            self.observer.end()
        observer = self.observer
        if left is not None:
            outcome, retry_after = _classify(left)
        else:
            outcome, retry_after = _judge(observer)
        if outcome == "failure":
            outcome = _mid_stream(self.req, self.observer, self.ticket)
        if _nothing_to_record(self.ticket, outcome):
            return None
        if outcome == "saturation":
            return self._saturated()
        return self.breaker.record(self.route, self.name, self.ticket, outcome, retry_after)

    def _saturated(self) -> Awaitable[None]:
        """Record a saturation, naming the backend (so that an open starts its re-checks)."""
        req = self.req
        attempt = req.attempt if req is not None and req.in_chain else None
        backend = attempt.backend if attempt is not None else self.breaker._alone_backend
        wire = req.wire if req is not None else None
        return self.breaker.record(
            self.route, self.name, self.ticket, "saturation", None, backend, wire
        )

    def send(self, message: Message) -> Awaitable[None]:
        """Alone: note what passes in the observer, and pass it on unchanged."""
        send = self.downstream
        assert send is not None
        kind = message["type"]
        observer = self.observer
        if kind == "http.response.body":
            try:
                observer.body(message.get("body", b""))
            except TierchainError:
                pass  # an over-long event: the stream is judged at its end
            if not message.get("more_body", False):
                observer.end()
        elif kind == "http.response.start":
            observer.start(int(message["status"]), list(message.get("headers", ())))
        return send(message)
