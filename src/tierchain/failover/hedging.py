"""Hedging: when in doubt about a quiet tier, also start the next one.

Failover runs one attempt at a time. With ``hedge_after`` set, an attempt at a tier
that may be hedged (a backend marked ``hedge=True``, or, with ``hedge`` left None, a
local one: regime ``local``, or with no regime written a loopback or private URL host)
and that is not the chain's last gets a timer (:class:`Hedging.arm`). When it fires
with no first data event yet, nothing committed and no firm verdict from the watchdog
(no status asked, or it said ``working`` or ``unknown``), and the budget leaves the
next tier what it needs, the next tier is started beside it (a :class:`Race`):

- the hedge has its own :class:`~tierchain.request.TierRequest` (a copy of the
  request's facts; the attempt trail and the state channel are shared) in its own
  copy of the scope, its own task, owned by the race (cancelled and awaited when the
  request ends) and armed with its own :class:`~tierchain._runtime.interrupt.Interruption`;
- each side's responder holds its bytes until its first data event, as every attempt's
  does; the first to commit (:meth:`Race.claim`, Failover's commit hook) wins, and the
  other is cancelled and recorded as ``hedge_lost``: a hedge that lost leaves its
  Breaker nothing (a neutral outcome), a first tier that lost a saturation (never a
  failure), so a tower that keeps losing is skipped before sending;
- a failure of one side before data is an ordinary failure of that backend; the
  request fails over only when both are out, and then past the hedged tier.

The hedge runs as every attempt does: its responder is Failover's (``_begin``), and its
call of the inner app is the one of :mod:`~tierchain.failover.attempt`
(:func:`~tierchain.failover.attempt.call_inner`). Failover's hooks (marked ``# [hedge]``
there): :meth:`Hedging.arm` before an attempt's inner call, :meth:`Race.conclude` in
place of the responder's ``conclude``, :meth:`Race.close` in the attempt's ``finally``,
and :meth:`Race.claim` at the top of the responder's ``commit`` and ``commit_held``.
"""

from __future__ import annotations

import asyncio
import contextvars
from datetime import timedelta
from typing import Any

from opentelemetry.trace import INVALID_SPAN

from .._checks import duration
from .._runtime import clock, deadlines
from .._runtime.interrupt import Interruption
from ..backend import Backend, is_local
from ..errors import BackendSaturated
from ..request import Attempt, TierRequest
from ..telemetry import ATTR_HEDGE_FOR, ATTR_HEDGE_WITH, HEDGES, labelled, log_event
from .attempt import Owner, Responder, call_inner
from .plan import record
from .route import ScopeCopy

__all__ = ["HEDGE_LOST", "UNCERTAIN", "Hedging", "Race", "hedged_by_default", "may_hedge"]

HEDGE_LOST = "hedge_lost"
"""The outcome of the side of a race that lost: cancelled, never a failure."""

UNCERTAIN = frozenset({None, "working", "unknown"})
"""The watchdog's verdicts (``Attempt.verdict``) under which a quiet attempt is hedged:
none yet (no status URL, or not asked yet), ``working`` and ``unknown``. Every other
verdict (``too_slow``, ``no_progress``, ``saturated``, a busy status) already fails over."""

MIN_LEFT = 1.0
"""Budget seconds below which no hedge starts (besides the reserve the watchdog keeps)."""


def hedged_by_default(backend: Backend) -> bool:
    """True for a backend whose ``hedge`` is None and that is local
    (:func:`~tierchain.backend.is_local`: regime ``local``, or, when no regime was
    written, a loopback or private URL host). A declared regime wins over the address:
    a paid API behind a private endpoint declared ``hosted`` is not paid twice."""
    return is_local(backend)


def may_hedge(backend: Backend) -> bool:
    """True when ``backend``'s attempts may be hedged once hedging is on: ``hedge`` when
    written, else :func:`hedged_by_default`."""
    return backend.hedge if backend.hedge is not None else hedged_by_default(backend)


class Hedging:
    """Failover's hedging policy: which attempts get a timer, and after how long."""

    __slots__ = ("_may", "after")

    def __init__(self, after: float) -> None:
        self.after = after
        self._may: dict[Backend, bool] = {}

    @staticmethod
    def checked(hedge_after: float | timedelta | None) -> float | None:
        """Failover's ``hedge_after`` through the one duration check (seconds, or None)."""
        if hedge_after is None:
            return None
        return duration("hedge_after", hedge_after, allow_zero=True)

    @classmethod
    def build(cls, hedge_after: float | timedelta | None) -> Hedging | None:
        """The policy for Failover's ``hedge_after`` (None or 0: off, no policy at all)."""
        after = cls.checked(hedge_after)
        return cls(after) if after else None

    def may_hedge(self, backend: Backend) -> bool:
        """True when ``backend``'s attempts may be hedged (``hedge``, else local)."""
        may = self._may.get(backend)
        if may is None:
            may = self._may[backend] = may_hedge(backend)
        return may

    def arm(self, failover: Owner, responder: Responder, scope: ScopeCopy) -> Race | None:
        """The race for ``responder``'s attempt with its timer running, or None: not hedged
        (the last tier, a second try, a continuation, a pool, the next tier on the same
        hardware, a backend not marked for it)."""
        req, attempt = responder.req, responder.attempt
        backend = attempt.backend
        if (
            attempt.is_last
            or attempt.retry
            or attempt.force
            or req.continuation is not None
            or req.committed
            or backend.pool is not None
            or attempt.n >= len(req.chain)
            or not self.may_hedge(backend)
        ):
            return None
        nxt = req.chain[attempt.n]
        if nxt.pool is not None or nxt.name == backend.name:
            return None
        if backend.shares is not None and nxt.shares == backend.shares:
            return None
        return Race(self.after, failover, responder, nxt, scope)


class Race:
    """One attempt and (once its timer fired in doubt) its hedge on the next tier."""

    __slots__ = (
        "_counted",
        "attempt",
        "failover",
        "first",
        "first_over",
        "guard",
        "hedge",
        "hedge_failed",
        "hedge_settled",
        "hreq",
        "lost",
        "next",
        "req",
        "scope",
        "second",
        "send",
        "started",
        "task",
        "timer",
        "winner",
    )

    def __init__(
        self, after: float, failover: Owner, responder: Responder, nxt: Backend, scope: ScopeCopy
    ) -> None:
        """``responder``'s attempt, hedged on ``nxt`` if it is still in doubt after ``after``
        seconds; ``scope`` gives the hedge its copy of the request's scope."""
        self.failover = failover
        self.req = responder.req
        self.attempt = responder.attempt
        self.first = responder
        responder.race = self
        self.next = nxt
        # The hedge's attempt is called as the first one was: the same disconnect guard,
        # the same caller's send, a copy of the same scope.
        self.guard = responder.guard
        self.send = responder.caller_send
        self.scope = scope
        self.timer: deadlines.Deadline | None = deadlines.schedule(
            after, self._due, context=contextvars.copy_context()
        )
        self.task: asyncio.Task[bool] | None = None
        self.hreq: TierRequest | None = None
        self.hedge: Attempt | None = None
        self.second: Responder | None = None
        self.winner: str | None = None  # "first" or "hedge", once one committed
        self.first_over = False  # the first attempt's app has returned
        self.hedge_failed = False  # the hedge ended before data, on its own
        self.hedge_settled = False  # the hedge's outcome is in the trail
        self.lost = False  # the hedge is being cancelled by the race
        self._counted = False
        self.started = clock.now()  # the first attempt's start

    # -- the timer --------------------------------------------------------------

    def _due(self) -> None:
        """``hedge_after`` passed: start the hedge if the attempt is still in doubt."""
        self.timer = None
        req, attempt = self.req, self.attempt
        observer = req.observer
        if (
            self.first_over
            or req.committed
            or req.aborted
            or req.attempt is not attempt
            or observer is None
            or observer.first_data_at is not None
            or attempt.verdict not in UNCERTAIN
        ):
            return
        left = req.remaining()
        if left is not None and left <= max(attempt.reserve, MIN_LEFT):
            log_event(
                "dispatch.hedge_skipped",
                route=attempt.route,
                backend=attempt.backend.name,
                hedge=self.next.name,
                left_s=round(left, 3),
                reason="budget",
            )
            return
        self._start()

    def _start(self) -> None:
        req, attempt, nxt = self.req, self.attempt, self.next
        hreq = self.hreq = _twin(req)
        self.hedge = Attempt(attempt.n + 1, attempt.of, nxt, attempt.route)
        after = round(clock.now() - attempt.started, 1)
        req.emit("hedging", backend=attempt.backend.name, **{"with": nxt.name}, after_s=after)
        log_event(
            "dispatch.hedging",
            route=attempt.route,
            backend=attempt.backend.name,
            hedge=nxt.name,
            after_s=after,
        )
        span = self.first.span
        if span is not INVALID_SPAN and span is not None:
            span.set_attribute(ATTR_HEDGE_WITH, nxt.name)
        task = self.task = asyncio.get_running_loop().create_task(self._run())
        hreq.interruption = Interruption.on(task)

    # -- the hedge's own attempt ------------------------------------------------

    async def _run(self) -> bool:
        """The hedge, as Failover runs an attempt: True when the caller has its answer."""
        failover, hreq, attempt = self.failover, self.hreq, self.hedge
        assert hreq is not None
        assert attempt is not None
        responder = failover._begin(hreq, self.guard, self.send, attempt)
        responder.race = self
        self.second = responder
        span = responder.span
        if span is not INVALID_SPAN:
            span.set_attribute(ATTR_HEDGE_FOR, self.attempt.backend.name)
        try:
            error = await call_inner(failover, hreq, responder, self.guard, self.scope)
            if self.lost:
                responder.outcome = HEDGE_LOST
                return False  # cancelled by the race: recorded there, nothing to count
            answered = await responder.conclude(error)
            self.hedge_settled = True
            if not answered and not responder.committed:
                self.hedge_failed = True
            return answered
        except BaseException:
            if not self.hedge_settled:
                self.hedge_settled = True
                responder.outcome = self.req.cancel_reason or "cancelled"
                record(hreq, attempt, responder.outcome)
            raise
        finally:
            error = None
            lease = responder.end()
            if lease is not None:
                await failover._give_back(lease)

    # -- Failover's hooks --------------------------------------------------------

    def claim(self, responder: Responder) -> bool:
        """A side is about to commit: True when it may (the first to ask wins and the
        other is cancelled), False for the side that lost (nothing of it is sent)."""
        if self.winner is not None:
            return (self.winner == "first") == (responder is self.first)
        if self.task is None:  # no hedge started: none will now
            deadlines.cancel(self.timer)
            self.timer = None
            return True
        req = self.req
        if responder is self.first:
            self.winner = "first"
            self._count("first")
            if not self.hedge_settled and not self.hedge_failed:
                self._cancel_hedge(HEDGE_LOST)
            return True
        self.winner = "hedge"
        self._count("hedge")
        hreq = self.hreq
        assert hreq is not None
        if not self.first_over:
            # The first attempt is cancelled: no failure, but a saturation (it gave no
            # first token in hedge_after plus the hedge's own time), so that a tower
            # that keeps losing opens its breaker for saturation and the callers after
            # are skipped past it before sending. Failover's hook settles the record.
            self.first.outcome = HEDGE_LOST
            record(req, self.attempt, HEDGE_LOST)
            waited = clock.now() - self.started
            req.attempt_error = BackendSaturated(
                f"backend {self.attempt.backend.name!r} gave no first chunk in "
                f"{waited:.1f}s; the hedge on the next tier answered first",
                waited=waited,
                why=HEDGE_LOST,
            )
            if not req.aborted:
                req.aborted = True
                if req.interruption is not None:
                    req.interruption.interrupt("tierchain: hedge_won")
        # From here the hedge is the request's attempt, for the layers outside Failover.
        req.attempt = hreq.attempt
        req.observer = hreq.observer
        req.committed = True
        return True

    async def conclude(
        self, responder: Responder, error: BaseException | None
    ) -> tuple[bool, Attempt]:
        """In place of the first attempt's ``conclude``: True when the caller has its
        answer, and the attempt the chain goes on after (the hedge's, once one ran)."""
        self.first_over = True
        deadlines.cancel(self.timer)
        self.timer = None
        if self.task is None:
            return await responder.conclude(error), self.attempt
        hedge = self.hedge
        assert hedge is not None
        if self.winner == "hedge":
            _no_second_try(responder)
            return await self._hedge_result(), hedge
        answered = await responder.conclude(error)
        if answered or self.winner == "first" or responder.committed:
            return answered, self.attempt
        # The first failed before data: the hedge goes on alone (no second try of the
        # first's backend: the request fails over only when both are out).
        _no_second_try(responder)
        return await self._hedge_result(), hedge

    async def close(self) -> None:
        """The first attempt is over (answered, failed, or the request is ending):
        cancel the hedge if it still runs, and wait for its task."""
        deadlines.cancel(self.timer)
        self.timer = None
        task = self.task
        if task is None:
            return
        if not task.done():
            if not self.hedge_settled:
                self._cancel_hedge(self.req.cancel_reason or "cancelled")
            await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # retrieved: raised where it mattered, or nothing to say
        self._count("none")

    def first_unrecorded(self, since: int) -> bool:
        """True while the first attempt has no record in the trail after ``since`` (the
        trail's length when it began; the hedge's records, at another ``n``, do not count)."""
        n = self.attempt.n
        return not any(r.n == n for r in self.req.attempts[since:])

    # -- inside ------------------------------------------------------------------

    async def _hedge_result(self) -> bool:
        task = self.task
        assert task is not None
        assert self.hreq is not None
        answered = await task
        if not answered:
            hreq = self.hreq
            if hreq.continuation is not None:
                self.req.continuation = hreq.continuation  # the hedge's stream broke
            else:
                self._count("none")
        return answered

    def _cancel_hedge(self, outcome: str) -> None:
        hreq, hedge = self.hreq, self.hedge
        assert hreq is not None
        assert hedge is not None
        self.lost = True
        self.hedge_settled = True
        if self.second is not None:
            self.second.outcome = outcome
        record(hreq, hedge, outcome)
        hreq.attempt_error = None
        if not hreq.aborted:
            hreq.aborted = True
            if hreq.interruption is not None:
                hreq.interruption.interrupt(f"tierchain: {outcome}")

    def _count(self, winner: str) -> None:
        if self._counted:
            return
        self._counted = True
        attempt = self.attempt
        labelled(HEDGES, attempt.route or "", attempt.backend.name, winner).inc()
        log_event(
            "dispatch.hedged",
            route=attempt.route,
            backend=attempt.backend.name,
            hedge=self.next.name,
            winner=winner,
        )


def _no_second_try(responder: Responder) -> None:
    """After a race, the first attempt's backend is not tried again (``retries``): the
    chain goes on past the hedge. A fault that says its hardware is taken is kept."""
    fault = responder.fault
    if fault is not None and fault.again:
        responder.fault = None


def _twin(req: TierRequest) -> TierRequest:
    """The hedge's own request object: the request's facts copied, its attempt fields
    fresh; the attempt trail and the state channel shared (both sides appear in them)."""
    twin = TierRequest()
    twin.route = req.route
    twin.chain = req.chain
    twin.attempts = req.attempts
    twin.deadline = req.deadline
    twin.budget = req.budget
    twin.body = req.body
    twin.streaming = req.streaming
    twin.in_chain = True
    twin.started = req.started
    twin.send_timeout = req.send_timeout
    twin.wire = req.wire
    twin.subscribe(lambda event: _relay(req, event))
    return twin


def _relay(req: TierRequest, event: dict[str, Any]) -> None:
    """The hedge's state events, on the request's own channel (Heartbeats listens there)."""
    fields = {k: v for k, v in event.items() if k != "state"}
    req.emit(event["state"], **fields)
