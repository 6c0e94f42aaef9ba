"""How late the event loop has been running: the gateway's own slowness, measured.

A connect timeout on a healthy backend is sometimes the gateway's doing: when
its event loop is overloaded, a connection the kernel made in microseconds is
not noticed before the timer fires. :func:`lag_since` tells such a timeout from
the backend's own. An entry on the scheduler (:mod:`.deadlines`) ticks every
``PERIOD`` seconds in each event loop that asked (from its first use) and
remembers how late each tick ran. It stands in for a task looping over
``asyncio.sleep(PERIOD)``: no task is involved.
"""

from __future__ import annotations

import asyncio
from collections import deque

from . import clock, deadlines
from .loops import PerLoop

__all__ = ["PERIOD", "lag_since", "watch"]

PERIOD = 0.05
_KEEP = 200  # ticks remembered: 10 s


class _Monitor:
    __slots__ = ("expected", "started", "ticks")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.ticks: deque[tuple[float, float]] = deque(maxlen=_KEEP)  # (when, how late)
        self.expected = 0.0
        self.started = False

    def start(self) -> None:
        self.started = True
        self.expected = clock.now() + PERIOD
        deadlines.schedule(PERIOD, self._tick)

    def _tick(self) -> None:
        now = clock.now()
        self.ticks.append((now, max(0.0, now - self.expected)))
        self.expected = now + PERIOD
        deadlines.schedule(PERIOD, self._tick)

    def lag_since(self, since: float) -> float:
        now = clock.now()
        worst = max(0.0, now - self.expected)  # a tick that is overdue right now
        for when, late in reversed(self.ticks):
            if when < since:
                break
            if late > worst:
                worst = late
        return worst


_MONITORS: PerLoop[_Monitor] = PerLoop(_Monitor)


def watch() -> None:
    """Start measuring the running loop's lag (once per loop; cheap to call again)."""
    monitor = _MONITORS.get()
    if not monitor.started:
        monitor.start()


def lag_since(since: float) -> float:
    """The most the running loop ran late since ``since`` (monotonic seconds); 0 if not watched."""
    monitor = _MONITORS.get()
    return monitor.lag_since(since) if monitor.started else 0.0
