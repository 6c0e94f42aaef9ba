"""How late the event loop has been running: the gateway's own slowness, measured.

A connect timeout on a healthy backend is sometimes the gateway's doing: when
its event loop is overloaded, a connection the kernel made in microseconds is
not noticed before the timer fires. :func:`lag_since` tells such a timeout from
the backend's own. An entry on the scheduler (:mod:`.deadlines`) ticks every
``PERIOD`` seconds in each event loop while someone holds the monitor (a
Forwarder's connection set-up, from :func:`hold` to :func:`release`; or
:func:`watch`, for good) and remembers how late each tick ran. It stands in for
a task looping over ``asyncio.sleep(PERIOD)``: no task is involved. A gateway
whose requests are all connected (streams parked on a quiet backend, say) has no
tick at all: no wake-up twenty times a second for a measure nobody will read.
"""

from __future__ import annotations

import asyncio
from collections import deque

from . import clock, deadlines
from .loops import PerLoop

__all__ = ["PERIOD", "hold", "lag_since", "lost_since", "release", "watch"]

PERIOD = 0.05
_KEEP = 200  # ticks remembered: 10 s


class _Monitor:
    __slots__ = ("expected", "held", "started", "ticks")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.ticks: deque[tuple[float, float]] = deque(maxlen=_KEEP)  # (when, how late)
        self.expected = 0.0
        self.started = False  # a tick is scheduled
        self.held = 0  # holders; -1 once watched for good

    def start(self) -> None:
        self.started = True
        self.expected = clock.now() + PERIOD
        deadlines.schedule(PERIOD, self._tick)

    def _tick(self) -> None:
        now = clock.now()
        self.ticks.append((now, max(0.0, now - self.expected)))
        if self.held == 0:  # nobody holds it: the ticks stop here
            self.started = False
            return
        self.expected = now + PERIOD
        deadlines.schedule(PERIOD, self._tick)

    def lost_since(self, since: float) -> float:
        """The time the loop lost since ``since``: every tick's lateness, summed (with the
        one overdue now). A loop starved of CPU runs each tick late; the sum is how much
        later than asked everything it did came, the gateway's own delay."""
        now = clock.now()
        lost = max(0.0, now - self.expected) if self.started else 0.0
        for when, late in reversed(self.ticks):
            if when < since:
                break
            lost += late
        return lost

    def lag_since(self, since: float) -> float:
        now = clock.now()
        # A tick that is overdue right now (none is while the ticks are stopped).
        worst = max(0.0, now - self.expected) if self.started else 0.0
        for when, late in reversed(self.ticks):
            if when < since:
                break
            if late > worst:
                worst = late
        return worst


_MONITORS: PerLoop[_Monitor] = PerLoop(_Monitor)


def watch() -> None:
    """Measure the running loop's lag for good (once per loop; cheap to call again)."""
    monitor = _MONITORS.get()
    monitor.held = -1
    if not monitor.started:
        monitor.start()


def hold() -> None:
    """Measure the running loop's lag until the matching :func:`release`."""
    monitor = _MONITORS.get()
    if monitor.held >= 0:
        monitor.held += 1
    if not monitor.started:
        monitor.start()


def release() -> None:
    """One :func:`hold` is over; the ticks stop at the next one once none is held."""
    monitor = _MONITORS.get()
    if monitor.held > 0:
        monitor.held -= 1


def lost_since(since: float) -> float:
    """The time the running loop lost since ``since`` (monotonic seconds): its ticks'
    lateness summed, as they saw it (0 if none ran since)."""
    return _MONITORS.get().lost_since(since)


def lag_since(since: float) -> float:
    """The most the running loop ran late since ``since`` (monotonic seconds), as its
    ticks saw it (0 if none ran since)."""
    return _MONITORS.get().lag_since(since)
