"""One attempt under the watchdog (:class:`Watch`): its timer, reading the attempt's
observer; what it decides when a point falls due (the status asked through
:mod:`tierchain.progress`; a cut said by :mod:`tierchain.verdicts`), and what a healthy
attempt teaches the learned normals (:mod:`tierchain.learned`)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol

from opentelemetry import trace

from ._disconnect import WATCH_AFTER
from ._runtime import clock, deadlines
from ._runtime.deadlines import EARLY, Deadline
from ._runtime.interrupt import Interruption
from ._types import Message, Send
from .decode import DecodeWatch
from .errors import BackendBusy, BackendSaturated, BackendUnavailable, StreamError
from .learned import DecodeRate, LearnedGap, SharedNormals
from .observer import Observer, nothing_sent, whole_events
from .progress import Asker, Progress
from .request import Attempt, TierRequest
from .suspect_marks import SuspectMarks
from .telemetry import ATTR_BACKEND, PROBE_ANSWERS, labelled, log_event, tracing_enabled
from .usage import read_usage

__all__ = ["SILENT", "Keeper", "Watch"]

SILENT = 5.0  # a committed stream silent this long (or its stall window) when the budget ends it


class Keeper(Asker, Protocol):
    """What a watch needs of the watchdog that made it (``SaturationWatchdog``)."""

    slow_after: float | Callable[[bytes], float]
    learned_gap: LearnedGap | None
    decode: DecodeRate | None
    normals: SharedNormals | None
    suspects: SuspectMarks


class Watch:
    """One attempt under the watchdog: its timer, reading the attempt's observer.

    The waits are one deadline at a time in the loop's shared deadline queue,
    not a task: an attempt that answers in time costs one queue entry, and a
    streamed chunk costs the watchdog nothing. A task exists only while a
    status probe is out.

    Four points in time bound the wait for the first chunk: the window's end
    (extended by ``working`` answers), the expected prefill (the prompt rate's
    limit, or the backend's own ``first_token``), the ceiling (never extended)
    and the reserve's point (``deadline - reserve``: never extended, absent on
    the last tier). The timer is armed for the soonest (:meth:`_due`).
    ``send``: alone (no Failover), the downstream ``send`` its own observer is
    fed from (:meth:`send`).
    """

    __slots__ = (
        "_ceiling_at",
        "_cut",
        "_cut_passed",
        "_deadline_at",
        "_decode_from",
        "_first_token",
        "_handle",
        "_prefill_end",
        "_prober",
        "_progress",
        "_prompt_due",
        "_send",
        "_slow_logged",
        "_waits",
        "_window_end",
        "attempt",
        "cut",
        "decoding",
        "fired",
        "healthy",
        "last",
        "learned",
        "marked",
        "observer",
        "own",
        "req",
        "reserve",
        "stall",
        "start",
        "watchdog",
        "window",
    )

    def __init__(
        self,
        watchdog: Keeper,
        req: TierRequest | None,
        attempt: Attempt | None,
        *,
        last: bool = True,
        window: float,
        learned: bool = False,
        stall: float,
        reserve: float = 0.0,
        prefill: float = math.inf,
        first_token: bool = False,
        send: Send | None = None,
    ) -> None:
        self.watchdog = watchdog
        self.req = req
        self.attempt = attempt
        self.last = last  # no later tier: nothing to move on to
        self.learned = learned  # the window was learned (two saturations under it forget it)
        self.window = window
        self.stall = stall
        self.reserve = reserve
        self.marked = False  # this attempt's verdict marked its backend suspect
        self.healthy = False  # it ended whole and taught the normals
        shared = req.observer if req is not None and req.in_chain else None
        # Alone, its own observer; inside a Failover a non-streaming answer is held until whole.
        self.own = shared is None
        self.observer = shared if shared is not None else Observer()
        self.start = start = clock.now()
        self.fired: str | None = None
        self._ceiling_at = start + watchdog.ceiling
        self._window_end = start + window if window > 0 else math.inf
        self._prefill_end = start + prefill
        self._prompt_due = False
        self._first_token = first_token  # the prefill's end is the backend's own limit
        # The attempt's deadline, else the request's (a Budget's; set before any attempt
        # starts, never moved).
        deadline = attempt.deadline if attempt is not None else None
        if deadline is None and req is not None:
            deadline = req.deadline
        self._deadline_at = deadline
        self._cut = deadline - reserve if reserve > 0 and deadline is not None else math.inf
        self._cut_passed = False  # a committed stream's reserve point passed (or cut it)
        self._progress: Progress | None = None  # the status conversation, once asked
        self._slow_logged = False
        self.decoding: DecodeWatch | None = None  # a committed stream's decode rate (judged)
        self._decode_from: tuple[float, int] | None = None  # its start, while it waits
        self._waits = False  # the timer waits for the request to run WATCH_AFTER
        self._send = send
        self.cut = Interruption()
        self._handle: Deadline | None = None
        self._prober: asyncio.Task[None] | None = None
        if reserve > 0 and (req.traced if req is not None else tracing_enabled()):
            trace.get_current_span().set_attribute("tierchain.reserve_s", round(reserve, 3))

    def begin(self) -> None:
        """Start timing the attempt (the running task is the one the timer may interrupt)
        from whichever point comes first, or raise BackendBusy when the reserve's point
        has already passed."""
        if self._cut <= self.start:  # a later tier of a long chain, after the earlier ones
            why = f"no time left for {self.who} before the reserve"
            raise BackendBusy(why, why="reserve")
        self.cut.arm()
        due = self._due()
        if due == math.inf:
            return
        guard = self.req.guard if self.req is not None else None
        if guard is not None and guard.young and due - self.start > WATCH_AFTER:
            # Armed only if the request lives WATCH_AFTER seconds (most answers are over
            # sooner), then for whatever is due by then (:meth:`_schedule`), in the
            # request's context (the guard's call has none).
            self._waits = True
            guard.then.append(partial(contextvars.copy_context().run, self._grown))
            return
        if due == self._window_end:
            # A computed window varies by request: not a recurring delay (a learned one
            # recurs: one of the sketch's bucket edges times the margin).
            self._arm(self.window, fixed=not callable(self.watchdog.slow_after))
            return
        if due == self._ceiling_at:
            self._arm(self.watchdog.ceiling, fixed=True)
            return
        if due == self._prefill_end:
            delay = due - self.start  # (from the watch's start: it is armed as it starts)
            rate = self.watchdog.prompt_rate
            self._arm(delay, fixed=self._first_token or (rate is not None and rate.recurs(delay)))
            return
        self._arm(max(0.0, due - clock.now()), fixed=False)  # the reserve's point

    def _grown(self) -> None:
        """The request has run WATCH_AFTER seconds: arm the timer :meth:`begin` left for
        then, unless the attempt is over or it has been armed since."""
        if self._waits:
            self._waits = False
            if self.fired is None and self._handle is None:
                self._schedule()

    def end(self) -> Awaitable[object] | None:
        """The attempt is over: stop timing (its decode watch, its probe: the wait for
        the probe's end is returned)."""
        self._waits = False
        if self._handle is not None:
            deadlines.cancel(self._handle)
            self._handle = None
        self._decode_from = None  # (a decode watch that waits is not made)
        if self.decoding is not None:
            self.decoding.cancel()
            self.decoding = None  # (it holds the watch: no cycle outlives the attempt)
        prober = self._prober
        if prober is not None:
            prober.cancel()
            return asyncio.wait([prober])
        return None

    @property
    def backend(self) -> str | None:
        return self.attempt.backend.name if self.attempt is not None else None

    @property
    def who(self) -> str:
        """This attempt's backend as a message names it: ``backend 'tower'``, or ``the
        backend`` for a watchdog alone (no Failover named one)."""
        return "the backend" if self.attempt is None else f"backend {self.attempt.backend.name!r}"

    @property
    def route(self) -> str:
        return (self.attempt.route if self.attempt is not None else None) or ""

    # -- the attempt -------------------------------------------------------

    def learn(self) -> None:
        """A successful attempt teaches the learned normals: its time to first data
        (a held answer: to the whole answer) and its stream's mean gap."""
        observer = self.observer
        first_at = observer.first_data_at
        attempt = self.attempt
        req = self.req
        if (
            attempt is None
            or first_at is None
            or (req is not None and req.attempt_error is not None)
            or observer.verdict() != "ok"
        ):
            return
        name = attempt.backend.name
        self.healthy = True
        watchdog = self.watchdog
        body = req.body if req is not None else None
        learned = watchdog.learned
        if learned is not None:
            end = first_at if observer.framed or self.own else clock.now()
            learned.observe(name, body, end - self.start)
        rate = watchdog.prompt_rate
        if rate is not None:
            if rate.calibrating(name):  # the bytes per token its answers report
                rate.calibrate(name, body, read_usage(observer.wire, observer.tail_values())[0])
            if observer.framed:  # a first token's own time
                rate.observe(name, body, first_at - self.start)
        gaps = watchdog.learned_gap
        events = observer.data_events
        if gaps is not None and events > 2 and (observer.sse or observer.ndjson):
            last = observer.last_event_at or first_at
            gaps.observe(name, None, (last - first_at) / (events - 1))
        decode = watchdog.decode
        if decode is not None and (observer.sse or observer.ndjson):
            decode.observe(name, events, (observer.last_event_at or first_at) - first_at)
        if watchdog.normals is not None:
            watchdog.normals.taught(name)

    def suspect(self, why: str) -> None:
        """This attempt's verdict: its backend is suspect for the callers after (once)."""
        if self.attempt is None or self.marked:
            return
        self.marked = True
        self.watchdog.suspects.mark(self.route, self.attempt.backend.name, why)

    def broke(self, exc: BaseException | None) -> None:
        """The attempt ended in an error we did not cut: a stream that had reached the
        caller and broke (not the gateway's nor the caller's doing) makes it suspect."""
        req = self.req
        observer = self.observer
        if req is None or not req.committed or observer.reached_end():
            return
        cause = req.attempt_error if req.attempt_error is not None else exc
        if isinstance(cause, StreamError) or (
            isinstance(cause, BackendUnavailable) and not cause.gateway_fault
        ):
            self.suspect("broke_mid_stream")

    def cancelled(self) -> None:
        """Someone else cancelled the attempt (the budget, the caller): was it a stall?

        A committed stream that has been silent for its stall window (or
        ``SILENT`` seconds, if shorter) when the budget ends it stalled: that
        is the backend's fault, and left as the attempt's error for the Breaker.
        Not while a send to the caller is out: then the caller was not reading,
        and the silence was ours.
        """
        req = self.req
        observer = self.observer
        error = req.attempt_error if req is not None else None
        if isinstance(error, BackendSaturated) and error.why == "hedge_lost":
            # The hedge on the next tier answered first: no first chunk in that time.
            self.suspect("hedge_lost")
            return
        if (
            req is None
            or req.cancel_reason != "budget_exhausted"
            or not req.committed
            or observer.first_data_at is None
            or observer.ended
            or self.stall <= 0
            or req.caller_blocked_since is not None  # the caller's backpressure, not a stall
        ):
            return
        gap = clock.now() - self._quiet_since()
        if gap < min(self.stall, SILENT):
            return
        self._log_stall(gap)
        req.attempt_error = StreamError(
            f"{self.who} sent no data event for {gap:.1f}s when the budget ended",
            reason="stalled",
        )
        self.suspect("stalled")

    def send(self, message: Message) -> Awaitable[None]:
        """Alone: feed the watchdog's own observer and pass on whole events."""
        downstream = self._send
        assert downstream is not None
        observer = self.observer
        kind = message["type"]
        if kind == "http.response.body":
            if observer.sse:
                out = whole_events(observer, message)
                return downstream(out) if out is not None else nothing_sent()
            observer.body(message.get("body", b""))
            if not message.get("more_body", False):
                observer.end()
        elif kind == "http.response.start":
            observer.start(int(message["status"]), list(message.get("headers", ())))
        return downstream(message)

    def first_data(self) -> None:
        """The first chunk arrived: the window is over; time the gaps (and, with a later
        tier, the decode rate) from here."""
        if not self.own and not self.observer.framed:
            return  # a held answer's first bytes: its window runs on until it is whole
        now = clock.now()
        decode = self.watchdog.decode
        if decode is not None and not self.last and self.attempt is not None:
            guard = self.req.guard if self.req is not None else None
            events = self.observer.data_events
            if guard is not None and guard.young:  # made if the request lives WATCH_AFTER
                self._decode_from = (now, events)  # (most answers are over sooner)
                guard.then.append(self._decode_late)
            else:
                self.decoding = DecodeWatch(self, decode, self.attempt.backend, now, events)
        stall = self.stall
        if self._waits:
            if stall <= 0 or stall > WATCH_AFTER:
                # begin() left the first timer for the request's WATCH_AFTER, and nothing
                # falls due before then: begin() defers only a reserve's point that comes
                # later, and a stall window this long ends later too.
                return
            self._waits = False  # a stall window this short: timed from here, as below
        # The next point to look at: the first stall window's end, or the reserve's point
        # if that comes first (a committed stream that could be continued on the next tier
        # is cut there: _expired).
        end = now + stall if stall > 0 else math.inf
        cut = self._cut
        due = cut if cut < end else end
        handle = self._handle
        if handle is not None:
            if deadlines.due(handle) <= due < math.inf:
                return  # the armed timer comes first; _expired times the rest from it
            deadlines.cancel(handle)  # (the window's timer: no wait to time after it)
            self._handle = None
        if due < math.inf and self.fired is None:
            if due == end:
                self._arm(stall, fixed=True)  # the stall window: a recurring delay
            else:
                self._schedule()  # the reserve's point, a one-off, as _expired arms it

    def _decode_late(self) -> None:
        """The request has run WATCH_AFTER seconds: the decode watch :meth:`first_data` left
        for then (its first span from the first data event all the same), unless the
        attempt is over."""
        start, self._decode_from = self._decode_from, None
        decode = self.watchdog.decode
        if start is not None and decode is not None and self.attempt is not None:
            self.decoding = DecodeWatch(self, decode, self.attempt.backend, *start)

    def answered(self) -> bool:
        """True once the first chunk has arrived (for a held answer: all of it, or
        so much that Failover sent it on)."""
        observer = self.observer
        if observer.first_data_at is None:
            return False
        if observer.framed or self.own:
            return True
        return observer.ended or (self.req is not None and self.req.committed)

    # -- the timer ---------------------------------------------------------

    def _due(self, *, window: bool = True) -> float:
        """When the wait for the first chunk must next be looked at: the first of the
        window's end (unless ``window`` is False: a probe is out), the expected prefill,
        the reserve's point and the ceiling. math.inf when nothing bounds it, or when the
        request's deadline comes first: the budget ends this attempt then, a deadline,
        not a saturation."""
        due = min(self._ceiling_at, self._cut, self._prefill_end)
        if window and self._window_end < due:
            due = self._window_end
        deadline = self._deadline_at
        if deadline is not None and due >= deadline:
            return math.inf
        return due

    def _end(self) -> float:
        """The latest this attempt may wait, whatever a status says: the first of the
        reserve's point, the ceiling and the request's deadline (math.inf: none)."""
        deadline = self._deadline_at
        end = min(self._cut, self._ceiling_at)
        return end if deadline is None or end <= deadline else deadline

    def _schedule(self) -> None:
        """Arm the timer for the next thing that may fall due."""
        observer = self.observer
        if self.answered():
            if observer.ended:
                return
            due = self._quiet_since() + self.stall if self.stall > 0 else math.inf
            if not self._cut_passed:
                due = min(due, self._cut)
        else:
            due = self._due()
        if due == math.inf:
            return
        self._arm(max(0.0, due - clock.now()), fixed=False)

    def _quiet_since(self) -> float:
        """Since when the upstream has sent nothing that we read: its last data event,
        or the moment the caller took our last send back if that came later (while a
        send to the caller is out, nothing is read from the upstream)."""
        observer = self.observer
        last = observer.last_event_at or observer.first_data_at or self.start
        req = self.req
        if req is not None and req.caller_unblocked_at > last:
            return req.caller_unblocked_at
        return last

    def _arm(self, delay: float, *, fixed: bool) -> None:
        # Our callbacks log, emit and may start a probe: in the request's context.
        self._handle = deadlines.schedule(
            delay, self._expired, context=contextvars.copy_context(), fixed=fixed
        )

    def _expired(self) -> None:
        self._handle = None
        if self.fired is not None:
            return
        now = clock.now()
        observer = self.observer
        if self.answered():
            req = self.req
            if not self._cut_passed and now >= self._cut - EARLY:
                self._cut_passed = True
                if (
                    req is not None
                    and req.committed
                    and req.continuable
                    and req.caller_blocked_since is None  # (not reading: the caller's time)
                    and not observer.ended
                ):
                    # The reserve's point: the next tier finishes the answer (Failover).
                    self._fire("reserve")
                    return
            if req is not None and req.caller_blocked_since is not None and not observer.ended:
                # The caller is not reading, so neither are we: the upstream's silence
                # is not its own (Failover's send_timeout judges the caller). Look again
                # one stall window later.
                self._arm(self.stall or SILENT, fixed=True)
                return
            last = self._quiet_since()
            if self.stall > 0 and not observer.ended and now >= last + self.stall - EARLY:
                self._log_stall(now - last)
                self._fire("stalled")
            else:
                self._schedule()  # data arrived since: wait for the new gap
            return
        if now >= self._ceiling_at - EARLY:
            self._fire("ceiling")
            return
        if now >= self._cut - EARLY:
            self._fire("reserve")
            return
        if now >= self._prefill_end - EARLY:
            if self.req is None or self.req.streaming is not False:
                # The expected prefill at the backend's normal prompt rate (or its own
                # first_token limit) is over, with no first token: too slow, whatever a
                # status says.
                if self.attempt is not None:
                    self.attempt.verdict = "too_slow"
                self._fire("first_token" if self._first_token else "too_slow")
                return
            # A held answer has no first token to wait for: its status says whether a
            # slot still reads a prompt (too slow) or the answer is being written.
            self._prefill_end = math.inf
            self._prompt_due = True
            if self._prober is None or self._prober.done():
                self._prober = asyncio.create_task(
                    self._ask(now, window=False), name="tierchain-watchdog-probe"
                )
            self._schedule_probe_out(now)
            return
        if self._prober is not None and not self._prober.done():
            self._schedule_probe_out(now)
            return
        if now < self._window_end - EARLY:
            self._schedule()
            return
        if self.last:
            if not self._slow_logged:
                self._slow_logged = True
                self._slow(now)
            self._window_end = self._ceiling_at
            self._schedule()
            return
        backend = self.attempt.backend if self.attempt is not None else None
        if backend is None or backend.status_url is None:
            self._fire("no_first_chunk" if observer.first_data_at is None else "incomplete")
            return
        self._prober = asyncio.create_task(self._ask(now), name="tierchain-watchdog-probe")
        self._schedule_probe_out(now)

    def _schedule_probe_out(self, now: float) -> None:
        # A starved server answers its status slowly too: the reserve's point, the
        # ceiling and the expected prefill stay on the timer while the probe is out.
        due = self._due(window=False)
        if due != math.inf:
            self._arm(max(0.0, due - now), fixed=False)

    def _log_stall(self, gap: float) -> None:
        log_event(
            "dispatch.backend_stalled",
            level=logging.WARNING,
            route=self.route,
            backend=self.backend,
            idle_s=round(gap, 3),
            stall_after_s=self.stall,
        )
        trace.get_current_span().add_event(
            "tierchain.backend_stalled", {ATTR_BACKEND: self.backend or "", "idle_s": gap}
        )

    async def _ask(self, now: float, *, window: bool = True) -> None:
        """Ask the backend whether it is still working; extend, or call it saturated.
        ``window``: asked at a window's end (a ``working`` answer extends it by one)."""
        assert self.attempt is not None
        backend = self.attempt.backend
        assert backend.status_url is not None
        progress = self._progress
        if progress is None:
            body = self.req.body if self.req is not None else None
            progress = self._progress = Progress(
                self.watchdog, backend, self.route, body, self.start
            )
        deadline = self._deadline_at
        status = await progress.probe(min(self.watchdog.probe_timeout, self._end() - now))
        now = clock.now()
        if status is None and (self.fired is not None or now >= self._cut - EARLY):
            # Cut short at the reserve's point (a starved server answers its status
            # slowly too): no answer, so no verdict; the reserve ends the attempt.
            if self.fired is None and not self.answered():
                self._fire("reserve")
            return
        streaming = self.req is None or self.req.streaming is not False
        prompt_due, self._prompt_due = self._prompt_due, False
        verdict, self._prefill_end = progress.verdict(
            status, now, self._end(), self._prefill_end, streaming=streaming, prompt_due=prompt_due
        )
        labelled(PROBE_ANSWERS, backend.name, verdict).inc()
        self.attempt.verdict = verdict
        if self.fired is not None or self.answered():
            return  # the reserve or the ceiling fell due, or the first chunk arrived
        if deadline is not None and now >= deadline:
            return
        if self._handle is not None:  # the reserve's or the ceiling's timer
            deadlines.cancel(self._handle)
            self._handle = None
        if verdict == "unknown" and (not window or progress.unknown_holds(now)):
            # No answer is not evidence. At the expected prefill of an answer that does
            # not stream, the plain stopwatch does not judge (the window goes on); after
            # a ``working`` answer, the wait goes on as that answer said (one more window).
            if window:
                self._window_end += self.window
            self._schedule()
            return
        if verdict == "working":
            assert status is not None
            progress.working(status)
            if window:
                self._window_end += self.window
            elapsed = round(now - self.start, 1)
            log_event(
                "dispatch.backend_still_working",
                route=self.route,
                backend=backend.name,
                elapsed_s=elapsed,
                detail=status.detail,
                reserve_s=round(self.reserve, 3) if self.reserve else None,
            )
            if self.req is not None:
                pool = {"pool": backend.pool} if backend.pool is not None else {}
                self.req.emit("still_working", backend=backend.name, **pool, elapsed_s=elapsed)
            self._schedule()
            return
        self._fire("probe_unknown" if verdict == "unknown" else verdict)

    def starved(self, decode: DecodeWatch) -> None:
        """A committed stream's decode rate fell below its limit (:mod:`tierchain.decode`)."""
        self._fire("slow_decode")

    def _fire(self, reason: str) -> None:
        self.fired = reason
        self.cut.interrupt(f"tierchain: backend saturated ({reason})")

    def _slow(self, now: float) -> None:
        waited = round(now - self.start, 1)
        log_event(
            "dispatch.backend_slow",
            level=logging.WARNING,
            route=self.route,
            backend=self.backend,
            waited_s=waited,
            window_s=self.window,
            last_tier=True,
        )
        trace.get_current_span().add_event(
            "tierchain.backend_slow", {ATTR_BACKEND: self.backend or "", "waited_s": waited}
        )
        if self.req is not None and self.attempt is not None:
            backend = self.attempt.backend
            named: dict[str, Any] = {"backend": backend.name}
            if backend.pool is not None:
                named["pool"] = backend.pool
            self.req.emit("backend_slow", **named, waited_s=waited, failing_over=False)
