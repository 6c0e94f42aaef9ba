"""Budget: the whole request's deadline. Spent means 504, never a failover.

The budget comes from the request header (``X-Request-Timeout: 30`` or
``2.5``: seconds, a plain decimal), clipped to ``max``; without the header it
is ``default``; with neither there is no budget and the request passes through
untouched. A header that is not a finite positive decimal is answered 400.

While the inner app runs, ``TierRequest.deadline`` holds the deadline on the
monotonic clock, so Failover clips each attempt to it and the
SaturationWatchdog never mistakes the deadline for a saturation. When the
deadline passes, ``TierRequest.cancel_reason`` is set to
``"budget_exhausted"`` (so Failover records that outcome for the running
attempt, and a Breaker records nothing against the backend) and then the inner
app is cancelled. A Failover that finds the budget spent before a new attempt
raises :class:`~tierchain.errors.BudgetExhausted`, handled the same way.

The caller then gets:

- nothing sent yet: ``504`` with a JSON error of type ``budget_exhausted``;
- an event stream already started: an SSE error event of that type, sent at
  an event boundary (a partial event is dropped, never closed off), and the
  end of the stream;
- any other response already started: the connection is aborted (the server
  closes it), so the caller sees an incomplete response, never a silently
  short one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Awaitable
from datetime import timedelta

from opentelemetry import trace

from ._checks import duration
from ._disconnect import Young
from ._responses import send_final, send_json_error
from ._runtime import clock, deadlines
from ._runtime.interrupt import Interruption
from ._types import ASGIApp, Message, Receive, Scope, Send
from .errors import BudgetExhausted
from .observer import Observer, whole_events
from .request import TRAIL_HEADER, TierRequest, format_trail
from .sse import is_event_stream
from .telemetry import ATTR_OUTCOME, BUDGET_EXHAUSTED, log_event
from .wire import error_format

__all__ = ["Budget"]

_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")
_REASON = "budget_exhausted"


class Budget:
    """Give the whole request a deadline; answer 504 when it is spent.

    ``default`` is the budget in seconds when the request carries no
    ``header``; ``max`` caps what a header may ask for. Works in front of a
    Failover or alone in front of any ASGI app.

    Options: [Budget](budget.md).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        default: float | timedelta | None = None,
        header: str = "X-Request-Timeout",
        max: float | timedelta | None = None,
    ) -> None:
        self.app = app
        self.default = duration("Budget default", default, allow_none=True)
        self.max = duration("Budget max", max, allow_none=True)
        if not isinstance(header, str) or not header.strip():
            raise ValueError(f"Budget header must be a header name, got {header!r}")
        self.header = header.strip()
        self._key = self.header.lower().encode("latin-1")
        if self.default is not None and self.max is not None:
            self.default = min(self.default, self.max)

    def budget(self, scope: Scope) -> float | None:
        """Seconds of budget for this request (None: none). ValueError for a bad header."""
        key = self._key
        size = len(key)
        for name, value in scope.get("headers", ()):
            if len(name) == size and name.lower() == key:  # (a lower() only for a likely one)
                return self._asked(value)
        return self.default

    def _asked(self, value: bytes) -> float:
        """The budget the header's ``value`` asks for. ValueError when it is bad."""
        text = value.decode("latin-1").strip()
        if not _DECIMAL.fullmatch(text) or not math.isfinite(float(text)):
            raise ValueError(self._bad(text))
        seconds = float(text)
        if seconds <= 0:
            raise ValueError(self._bad(text))
        return seconds if self.max is None else min(seconds, self.max)

    def _bad(self, text: str) -> str:
        shown = text if len(text) <= 40 else text[:40] + "..."
        return (
            f"{self.header} must be a finite positive number of seconds written as a decimal "
            f"(such as 30 or 2.5), got {shown!r}"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            seconds = self.budget(scope)
        except ValueError as exc:
            return await send_json_error(
                send,
                400,
                str(exc),
                "invalid_request_error",
                "invalid_request_timeout",
                wire=error_format(scope.get("path") or ""),
            )
        if seconds is None:
            return await self.app(scope, receive, send)
        # The request under its budget, in this frame (a waiting stream holds one less).
        spend = _Spend(self, seconds, req := TierRequest.of(scope), send)
        cut = spend.cut
        try:
            await self.app(scope, receive, spend.inward)
        except asyncio.CancelledError:
            if not cut.ours():
                raise
            await spend.exhausted(send)
        except BudgetExhausted:
            req.cancel_reason = _REASON
            await spend.exhausted(send)
        else:
            if cut.interrupted:
                cut.swallowed()  # the app swallowed the cancellation and returned anyway
        finally:
            spend.over = True
            if spend.timer is not None:  # (None: a request over before the phase's end)
                deadlines.cancel(spend.timer)
            if spend.young is not None:  # the phase this layer started ends with it
                req.end_young(spend.young)
            req.body_pass = None  # (it holds this layer's send: no cycle outlives us)
            del spend.inward  # (its own bound method: a cycle of its own, broken here)


class _Spend:
    """One request under a budget: its timer and what has been sent.

    Inside a Failover, the events that reach this layer are already whole and
    it only notes the start and the end. Alone in front of an event stream it
    keeps an observer of its own, so that it too passes on whole events only. Made,
    it has set the request's deadline and timed it (``timer``), or, the deadline being
    later than the request's :class:`~tierchain._disconnect.Young` phase, left that to
    the phase's end (``timer`` None until then: a request answered sooner arms none).
    ``young``: the phase this layer started (the outermost with the request), else None.
    """

    __slots__ = (
        "_observer",
        "budget",
        "cut",
        "due",
        "finished",
        "inward",
        "lane",
        "over",
        "passes_to",
        "req",
        "seconds",
        "started",
        "timer",
        "young",
    )

    budget: Budget
    seconds: float
    req: TierRequest
    started: bool
    finished: bool
    _observer: Observer | None
    inward: Send
    passes_to: Send
    cut: Interruption
    due: float
    lane: float | None
    over: bool
    timer: deadlines.Deadline | None
    young: Young | None

    def __init__(self, budget: Budget, seconds: float, req: TierRequest, send: Send) -> None:
        self.budget = budget
        self.seconds = seconds
        self.req = req
        self.started = False
        self.finished = False
        self._observer = None
        self.passes_to = send
        self.inward = self.send  # (one bound method: the send handed inward)
        self.over = False
        delay = seconds
        now = clock.now()
        deadline = now + delay  # (timed from here)
        fixed = delay == budget.default  # most requests: the same delay, a FIFO
        if req.deadline is not None and req.deadline < deadline:
            # An outer budget: the earlier deadline wins.
            deadline, fixed = req.deadline, False
            delay = max(0.0, deadline - clock.now())
        req.deadline = deadline
        req.budget = delay if req.budget is None else min(req.budget, delay)
        cut = self.cut = Interruption()
        cut.arm()
        # At the deadline itself (no second clock reading); a fixed delay's FIFO holds it.
        self.due = deadline
        self.lane = delay if fixed else None
        self.timer = None
        self.young = req.after_young(now, deadline, self._arm)
        # A Failover holding ``inward`` notes the start here and sends it, and a going
        # stream's chunks, past this layer (until the request ends: Budget.__call__ lets
        # go of it); alone, or with a layer between that wraps the send, nothing reads it.
        req.body_pass = self

    def _arm(self) -> None:
        """Time the deadline (at once, or at the phase's end if the request is still here)."""
        if not self.over and self.timer is None:
            self.timer = deadlines.schedule_at(self.due, self._fire, lane=self.lane)

    def send(self, message: Message) -> Awaitable[None]:
        """Note what passes and pass it on: the inner send's own awaitable, no frame of ours."""
        send = self.passes_to
        kind = message["type"]
        if kind == "http.response.body":
            if self._observer is not None:
                return self._relay(message, self._observer, send)
            if not message.get("more_body", False):
                self.finished = True
        elif kind == "http.response.start":
            self.started = True
            if not self.req.in_chain and is_event_stream(message.get("headers", ())):
                self._observer = Observer()
        return send(message)

    async def _relay(self, message: Message, observer: Observer, send: Send) -> None:
        out = whole_events(observer, message)
        if out is not None:
            if not out["more_body"]:
                self.finished = True
            await send(out)

    def _fire(self) -> None:
        """The deadline: cancel the request's task, unless it is already answered."""
        if self.finished or self.cut.interrupted:
            return
        self.req.cancel_reason = _REASON  # before the cancellation lands
        self.cut.interrupt("tierchain: the request's budget is spent")

    async def exhausted(self, send: Send) -> None:
        req = self.req
        route = req.route or ""
        BUDGET_EXHAUSTED.labels(route).inc()
        trace.get_current_span().set_attribute(ATTR_OUTCOME, _REASON)
        trail = format_trail(req.attempts).decode()
        log_event(
            "request.budget_exhausted",
            level=logging.WARNING,
            route=route or None,
            budget_s=self.seconds,
            started=self.started,
            attempts=trail or None,
        )
        message = f"the request's budget of {self.seconds:g}s was spent before it was answered"
        if not self.started:
            headers = [(TRAIL_HEADER, trail.encode())] if trail else None
            await send_json_error(
                send,
                504,
                message,
                _REASON,
                _REASON,
                headers=headers,
                wire=req.wire,
                budget_s=self.seconds,
                attempts=[{"backend": r.backend, "outcome": r.outcome} for r in req.attempts],
            )
            return
        observer = self._observer if self._observer is not None else req.observer
        error = (
            None
            if observer is None or self.finished
            else observer.error_bytes(
                f"the request's budget of {self.seconds:g}s was spent mid-stream", _REASON, _REASON
            )
        )  # in the request's wire format (an NDJSON line, an Anthropic error event, ...)
        if observer is not None and error is not None:
            observer.drop_pending()  # a partial event never reaches the caller
            # Bounded: a caller that stopped reading is cut, not waited on.
            await send_final(
                send, {"type": "http.response.body", "body": error, "more_body": False}, req
            )
            return
        if not self.finished:
            raise BudgetExhausted(message)
