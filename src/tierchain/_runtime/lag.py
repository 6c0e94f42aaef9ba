"""How late the event loop has been running: the gateway's own slowness, measured.

A connect timeout on a healthy backend is sometimes the gateway's doing: when
its event loop is overloaded, a connection the kernel made in microseconds is
not noticed before the timer fires. :func:`lag_since` tells such a timeout from
the backend's own. One timer per event loop ticks every ``PERIOD`` seconds
(started on first use) and remembers how late each tick ran; no task is
involved.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque

from . import clock

__all__ = ["PERIOD", "lag_since"]

PERIOD = 0.05
_KEEP = 200  # ticks remembered: 10 s


class _Monitor:
    __slots__ = ("expected", "handle", "ticks")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # (Holds no reference to the loop: the loop's own timer heap keeps it alive.)
        self.ticks: deque[tuple[float, float]] = deque(maxlen=_KEEP)  # (when, how late)
        self.expected = clock.now() + PERIOD
        self.handle = loop.call_later(PERIOD, self._tick)

    def _tick(self) -> None:
        now = clock.now()
        self.ticks.append((now, max(0.0, now - self.expected)))
        self.expected = now + PERIOD
        self.handle = asyncio.get_running_loop().call_later(PERIOD, self._tick)

    def lag_since(self, since: float) -> float:
        now = clock.now()
        worst = max(0.0, now - self.expected)  # a tick that is overdue right now
        for when, late in reversed(self.ticks):
            if when < since:
                break
            if late > worst:
                worst = late
        return worst


_MONITORS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Monitor] = (
    weakref.WeakKeyDictionary()
)


def watch() -> None:
    """Start measuring the running loop's lag (once per loop; cheap to call again)."""
    loop = asyncio.get_running_loop()
    if loop not in _MONITORS:
        _MONITORS[loop] = _Monitor(loop)


def lag_since(since: float) -> float:
    """The most the running loop ran late since ``since`` (monotonic seconds); 0 if not watched."""
    monitor = _MONITORS.get(asyncio.get_running_loop())
    return monitor.lag_since(since) if monitor is not None else 0.0
