"""The watchdog after the first byte: a committed stream that moves far too slowly.

A GPU taken by another workload (a game) rarely stops: it slows to a crawl. A stream
whose tokens come every 0.2 to 0.9 s never trips the stall window, and the caller waits
fifteen times the answer's normal time with an idle hosted tier beside it. So once a
stream has committed on a tier with a later tier, its decode rate is judged against the
backend's normal (:class:`~tierchain.learned.DecodeRate`): every ``span`` seconds
(2 s), the data events of the last span are counted (one timer a span per stream: a
streamed chunk costs nothing here); two spans in a row below the limit (4 s: a pause of
a few seconds, another slot's prompt batch, is not enough) are **starved**, and the
stream is continued on the next tier like a stall (the watchdog raises
:class:`~tierchain.errors.BackendSaturated` with ``why="slow_decode"``; Failover
finishes the answer elsewhere, see docs/continuation.md).

Not judged: the last tier (nothing to move to), a stream Failover could not continue
(``TierRequest.continuable`` False: cutting it would only end it), a span in which the
caller was not reading (the upstream's silence is then ours), and a span with no data
event at all: silence is the stall window's to judge (``stall_after``), not slowness.
"""

from __future__ import annotations

from typing import Protocol

from ._runtime import clock, deadlines
from .backend import Backend
from .learned import DecodeRate
from .observer import Observer
from .request import TierRequest

__all__ = ["SPANS", "DecodeWatch"]

SPANS = 2
"""Spans in a row under the limit that make a stream starved."""


class _Watched(Protocol):
    """What a decode watch needs of the attempt's watch (``watch.Watch``)."""

    observer: Observer
    req: TierRequest | None
    fired: str | None

    def starved(self, decode: DecodeWatch) -> None: ...


class DecodeWatch:
    """One committed stream's decode rate (from ``now``, its first data event, and the
    ``events`` counted then), judged every ``span`` seconds against ``limit`` tokens a
    second: ``normal``'s limit for ``backend`` (``learned``: the backend's own normal, else
    its regime's cold default), taken at the first span's end (a stream that ends sooner
    is never judged, and asks nothing). ``rate`` is the last span's rate."""

    __slots__ = (
        "_at",
        "_backend",
        "_below",
        "_events",
        "_handle",
        "_normal",
        "learned",
        "limit",
        "rate",
        "span",
        "watch",
    )

    def __init__(
        self, watch: _Watched, normal: DecodeRate, backend: Backend, now: float, events: int
    ) -> None:
        self.watch = watch
        self._normal = normal
        self._backend = backend
        self.limit = 0.0  # (taken at the first span's end)
        self.learned = False
        self.span = span = normal.span
        self.rate = 0.0
        self._below = 0  # spans in a row below the limit
        self._at = now
        self._events = events
        # The first span's end, from the first data event (a watch made when the request
        # had run WATCH_AFTER seconds is made after it); the tick only interrupts the task:
        # it needs none of the request's context.
        self._handle: deadlines.Deadline | None = deadlines.schedule_at(
            now + span, self._tick, lane=span
        )

    def cancel(self) -> None:
        """The attempt is over: no more ticks."""
        if self._handle is not None:
            deadlines.cancel(self._handle)
            self._handle = None

    def _tick(self) -> None:
        self._handle = None
        watch = self.watch
        observer = watch.observer
        if watch.fired is not None or observer.ended:
            return
        now = clock.now()
        events = observer.data_events
        req = watch.req
        moved = events - self._events
        if not self.limit:  # the first span's end
            backend = self._backend
            self.limit, self.learned = self._normal.limit(backend.name, backend.regime)
        if (
            req is not None
            and req.continuable
            and req.caller_blocked_since is None  # (not reading: its silence is ours)
            and moved > 0  # (none at all: the stall window's to judge)
            and now > self._at
        ):
            rate = moved / (now - self._at)
            if rate < self.limit:
                self._below += 1
                self.rate = rate if self._below == 1 else min(self.rate, rate)
                if self._below >= SPANS:
                    watch.starved(self)
                    return
            else:
                self._below = 0
        else:
            self._below = 0
        self._at, self._events = now, events
        self._handle = deadlines.schedule(self.span, self._tick)
