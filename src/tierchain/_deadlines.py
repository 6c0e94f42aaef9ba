"""One loop timer for every per-request deadline (a budget, a watchdog window).

asyncio keeps its timers in a heap of handles compared by a Python-level
``__lt__``, and copies the context for each: a few microseconds per timer, paid
by every request for a deadline that almost never fires. Most of these
deadlines are "now plus the same delay" (a Budget's default, a backend's
``slow_after``), so they arrive in due order: a FIFO per delay holds them in
O(1). Other delays go into a heap of plain lists (compared in C). One asyncio
timer per event loop is armed at the earliest due time.

A deadline is a list ``[due, seq, callback, context]``; :func:`cancel` empties
its callback, and an emptied entry is dropped when it comes up (or when its
FIFO is compacted, so that cancelled entries never pile up for long).
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import math
import time
from collections import deque
from collections.abc import Callable
from operator import itemgetter
from typing import Any

from ._loops import PerLoop, slack

__all__ = ["Deadline", "cancel", "due", "schedule"]

Deadline = list[Any]
"""A scheduled deadline: ``[due, seq, callback, context]`` (see the module docstring)."""

_due_of = itemgetter(0)
_COMPACT_AT = 1024  # a FIFO this long is filtered of cancelled entries (then twice as long)
_EMPTY_CONTEXT = contextvars.Context()


class _Timers:
    __slots__ = ("fifos", "handle", "heap", "heap_limit", "limits", "loop", "seq", "slack", "when")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.slack = slack(loop)  # how early a loop timer may fire
        self.fifos: dict[float, deque[Deadline]] = {}
        self.limits: dict[float, int] = {}
        self.heap: list[Deadline] = []
        self.heap_limit = _COMPACT_AT
        self.handle: asyncio.TimerHandle | None = None
        self.when = math.inf
        self.seq = 0

    def add(self, due: float, delay: float | None, entry: Deadline) -> None:
        if delay is None:
            self.seq += 1
            entry[1] = self.seq
            heap = self.heap
            heapq.heappush(heap, entry)
            if len(heap) >= self.heap_limit:  # cancelled entries deep in the heap
                heap[:] = [e for e in heap if e[2] is not None]
                heapq.heapify(heap)
                self.heap_limit = max(_COMPACT_AT, 2 * len(heap))
        else:
            fifo = self.fifos.get(delay)
            if fifo is None:
                fifo = self.fifos[delay] = deque()
                self.limits[delay] = _COMPACT_AT
            fifo.append(entry)
            if len(fifo) >= self.limits[delay]:
                self._compact(delay, fifo)
        if due < self.when:
            self._arm(due)

    def _compact(self, delay: float, fifo: deque[Deadline]) -> None:
        live = deque(e for e in fifo if e[2] is not None)
        self.fifos[delay] = live
        self.limits[delay] = max(_COMPACT_AT, 2 * len(live))

    def _arm(self, due: float) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.when = due
        loop = self.loop
        # An empty context: the timer belongs to no request (each entry has its own).
        self.handle = loop.call_at(
            loop.time() + (due - time.monotonic()), self._fire, context=_EMPTY_CONTEXT
        )

    def _fire(self) -> None:
        self.handle = None
        self.when = math.inf
        upto = time.monotonic() + self.slack
        ready: list[Deadline] = []
        for fifo in self.fifos.values():
            while fifo and fifo[0][0] <= upto:
                entry = fifo.popleft()
                if entry[2] is not None:
                    ready.append(entry)
        heap = self.heap
        while heap and heap[0][0] <= upto:
            entry = heapq.heappop(heap)
            if entry[2] is not None:
                ready.append(entry)
        if len(ready) > 1:
            ready.sort(key=_due_of)  # several queues may fall due in one wake
        for entry in ready:
            callback, context = entry[2], entry[3]
            if callback is None:
                continue  # cancelled by an earlier callback of this round
            entry[2] = None
            try:
                if context is None:
                    callback()
                else:
                    context.run(callback)
            except Exception as exc:  # one broken callback must not stop the others
                self.loop.call_exception_handler(
                    {"message": "tierchain deadline callback failed", "exception": exc}
                )
        nxt = math.inf
        for fifo in self.fifos.values():
            while fifo and fifo[0][2] is None:
                fifo.popleft()  # cancelled: no need to wake for it
            if fifo and fifo[0][0] < nxt:
                nxt = fifo[0][0]
        while heap and heap[0][2] is None:
            heapq.heappop(heap)
        if heap and heap[0][0] < nxt:
            nxt = heap[0][0]
        if nxt < math.inf and nxt < self.when:
            self._arm(nxt)


_TIMERS: PerLoop[_Timers] = PerLoop(_Timers)


def schedule(
    delay: float,
    callback: Callable[[], object],
    *,
    context: contextvars.Context | None = None,
    fixed: bool = True,
) -> Deadline:
    """Call ``callback`` (in ``context``, if given) ``delay`` seconds from now.

    ``fixed``: the same delay recurs (a configured window): it goes into that
    delay's FIFO. Pass False for a one-off delay (from a header, a remainder).
    Must be called from a running event loop; returns the deadline to cancel.
    """
    timers = _TIMERS.get()
    due = time.monotonic() + delay
    entry: Deadline = [due, 0, callback, context]
    fifo = timers.fifos.get(delay) if fixed else None
    if fifo is not None and len(fifo) < timers.limits[delay] and due >= timers.when:
        fifo.append(entry)  # the usual case: a recurring delay, nothing to re-arm
    else:
        timers.add(due, delay if fixed else None, entry)
    return entry


def cancel(entry: Deadline | None) -> None:
    """Cancel a deadline (a no-op for None or one that already fired)."""
    if entry is not None:
        entry[2] = None
        entry[3] = None


def due(entry: Deadline) -> float:
    """The monotonic time at which ``entry`` falls (or fell) due."""
    return float(entry[0])
