"""The scheduler: one loop timer per event loop for everything the package times.

Every per-request deadline (a budget, a watchdog window, a send timeout), the
disconnect guards' ``WATCH_AFTER``, Heartbeats' commits and keepalives and the
lag monitor's tick are entries here. This stands in for a ``loop.call_at`` per
entry (or an ``asyncio.sleep`` in a task per waiting stream, as sse-starlette's
``_ping`` has), because asyncio keeps its timers in a heap of handles compared by a Python-level
``__lt__``, and copies the context for each: a few microseconds per timer, paid
by every request for a deadline that almost never fires. Most of these
deadlines are "now plus the same delay" (a Budget's default, a backend's
``slow_after``), so they arrive in due order: a FIFO per delay holds them in
O(1). Other delays go into a heap (compared in C). One asyncio timer per event
loop is armed at the earliest due time.

A deadline is a :class:`Deadline` (``due``, ``seq``, ``callback``,
``context``, ``pending``), held by its caller, who only passes it to
:func:`cancel` or :func:`due`; while it is pending, ``pending`` (the loop's
table of pending deadlines) maps its ``seq`` to it, and its callback is None
once it fired or was cancelled. The queues hold only due times and
sequence numbers: floats and ints, which the garbage collector never tracks.
So a deadline cancelled long before it falls due (almost all of them) is
freed with its request, rather than waiting in a queue for its due time and
being promoted, with every other such entry, into the collector's oldest
generation, whose full passes then cost every request. A cancelled entry's
numbers are dropped when they come up, or when their queue is compacted.

One tolerance: a wake calls what falls due within ``EARLY`` of it, so entries
due close together are called in one wake. A callback that asks whether its
time has come compares with the same tolerance: ``EARLY``, from here, is the
package's only one. A lane may also be *loose* (``slack``): an entry of it that
falls due within its slack of a wake the loop makes anyway is called at that
wake, early, and the timer is never armed for it sooner than its own time.
Heartbeats' keepalives are such a lane: a thousand parked streams' keepalives,
spread over an interval, then share a few wakes a second instead of one each,
and a lone stream's keepalive still goes out on time.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from operator import attrgetter

from . import clock
from .loops import PerLoop

__all__ = ["EARLY", "Deadline", "Fifo", "cancel", "due", "schedule", "schedule_at"]

EARLY = 1e-3
"""The one tolerance: what falls due within this of a wake is called at it (a loop timer
may also fire a hair early: asyncio runs those due within its clock resolution, far less)."""


class Deadline:
    """A scheduled deadline, the handle :func:`schedule` and :func:`schedule_at` return:
    give it back to :func:`cancel` or :func:`due`; its fields are the scheduler's.

    Made, it is numbered and entered in its loop's pending entries; the scheduler then
    puts its due time in a FIFO or the heap.
    """

    __slots__ = ("callback", "context", "due", "pending", "seq")

    def __init__(
        self,
        timers: _Timers,
        due: float,
        callback: Callable[[], object],
        context: contextvars.Context | None,
    ) -> None:
        self.due = due
        seq = self.seq = timers.seq = timers.seq + 1
        self.callback: Callable[[], object] | None = callback
        """None once it fired or was cancelled."""
        self.context = context
        pending = self.pending = timers.pending
        pending[seq] = self


_due_of = attrgetter("due")
_COMPACT_AT = 1024  # a queue this long is filtered of cancelled entries (then twice as long)
_EMPTY_CONTEXT = contextvars.Context()


class Fifo:
    """Deadlines that arrive in due order (one recurring delay): due times and
    sequence numbers in two deques, which the garbage collector never tracks.

    What a number stands for is looked up in a table of pending entries; a
    number no longer in it was cancelled and is skipped. :meth:`compact` drops
    those once the queue has doubled since it was last compacted.
    """

    __slots__ = ("dues", "limit", "seqs", "slack")

    def __init__(self, slack: float = 0.0) -> None:
        self.dues: deque[float] = deque()
        self.seqs: deque[int] = deque()
        self.limit = _COMPACT_AT
        self.slack = slack  # a loose lane's: called this much early at a wake made anyway

    def push(self, due: float, seq: int, pending: Mapping[int, object]) -> None:
        """Queue ``seq`` at ``due`` (not before the last queued)."""
        self.dues.append(due)
        self.seqs.append(seq)
        if len(self.seqs) >= self.limit:
            self.compact(pending)

    def pop_due(self, upto: float) -> Iterator[int]:
        """The numbers due by ``upto``, taken off the queue."""
        dues, seqs = self.dues, self.seqs
        while dues and dues[0] <= upto:
            dues.popleft()
            yield seqs.popleft()

    def next_due(self, pending: Mapping[int, object]) -> float:
        """The earliest pending due time (``inf`` if none), dropping cancelled heads."""
        dues, seqs = self.dues, self.seqs
        while seqs and seqs[0] not in pending:
            dues.popleft()
            seqs.popleft()
        return dues[0] if dues else math.inf

    def compact(self, pending: Mapping[int, object]) -> None:
        """Drop the numbers of cancelled entries."""
        kept = [(d, s) for d, s in zip(self.dues, self.seqs, strict=True) if s in pending]
        self.dues = deque(d for d, _ in kept)
        self.seqs = deque(s for _, s in kept)
        self.limit = max(_COMPACT_AT, 2 * len(kept))


class _Timers:
    __slots__ = (
        "fifos",
        "handle",
        "heap",
        "heap_limit",
        "loop",
        "loose",
        "pending",
        "seq",
        "when",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.fifos: dict[float, Fifo] = {}
        self.loose: dict[float, Fifo] = {}  # loose lanes (a slack), by delay
        self.heap: list[tuple[float, int]] = []  # one-off delays: (due, seq)
        self.heap_limit = _COMPACT_AT
        self.pending: dict[int, Deadline] = {}
        self.handle: asyncio.TimerHandle | None = None
        self.when = math.inf
        self.seq = 0

    def add(self, entry: Deadline, delay: float | None, slack: float = 0.0) -> None:
        due, seq = entry.due, entry.seq
        pending = self.pending
        if delay is None:
            heap = self.heap
            heapq.heappush(heap, (due, seq))
            if len(heap) >= self.heap_limit:  # cancelled entries deep in the heap
                heap[:] = [item for item in heap if item[1] in pending]
                heapq.heapify(heap)
                self.heap_limit = max(_COMPACT_AT, 2 * len(heap))
        else:
            lanes = self.loose if slack else self.fifos
            fifo = lanes.get(delay)
            if fifo is None:
                fifo = lanes[delay] = Fifo(slack)
            fifo.push(due, seq, pending)
        if due < self.when:
            self._arm(due)

    def _arm(self, due: float) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.when = due
        loop = self.loop
        # An empty context: the timer belongs to no request (each entry has its own).
        self.handle = loop.call_at(
            loop.time() + (due - clock.now()), self._fire, context=_EMPTY_CONTEXT
        )

    def _fire(self) -> None:
        self.handle = None
        self.when = math.inf
        upto = clock.now() + EARLY
        pending = self.pending
        ready: list[Deadline] = []
        for fifo in self.fifos.values():
            for seq in fifo.pop_due(upto):
                entry = pending.pop(seq, None)
                if entry is not None:
                    ready.append(entry)
        for fifo in self.loose.values():
            for seq in fifo.pop_due(upto + fifo.slack):
                entry = pending.pop(seq, None)
                if entry is not None:
                    ready.append(entry)
        heap = self.heap
        while heap and heap[0][0] <= upto:
            entry = pending.pop(heapq.heappop(heap)[1], None)
            if entry is not None:
                ready.append(entry)
        if len(ready) > 1:
            ready.sort(key=_due_of)  # several queues may fall due in one wake
        for entry in ready:
            callback, context = entry.callback, entry.context
            if callback is None:
                continue  # cancelled by an earlier callback of this round
            entry.callback = None
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
            nxt = min(nxt, fifo.next_due(pending))  # (cancelled heads: no need to wake)
        for fifo in self.loose.values():
            nxt = min(nxt, fifo.next_due(pending))  # (its own time: never early for it)
        while heap and heap[0][1] not in pending:
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
    due = clock.now() + delay
    entry = Deadline(timers, due, callback, context)
    fifo = timers.fifos.get(delay) if fixed else None
    if fifo is not None and len(fifo.seqs) < fifo.limit and due >= timers.when:
        fifo.dues.append(due)  # the usual case: a recurring delay, nothing to re-arm
        fifo.seqs.append(entry.seq)
    else:
        timers.add(entry, delay if fixed else None)
    return entry


def schedule_at(
    due: float,
    callback: Callable[[], object],
    *,
    lane: float | None = None,
    slack: float = 0.0,
) -> Deadline:
    """Call ``callback`` at ``due`` (monotonic seconds, :func:`clock.now`'s), with no
    context of its own. ``lane``: the recurring delay that ``due`` is after a recent
    time (a stream's last output plus its interval): that delay's FIFO holds it while
    entries come in due order; without one (or out of order) it goes into the heap.
    ``slack`` (with a ``lane``; one slack per lane): the lane is loose, and the entry
    may be called up to ``slack`` early at a wake the loop makes for another entry."""
    timers = _TIMERS.get()
    entry = Deadline(timers, due, callback, None)
    if lane is not None:
        fifo = (timers.loose if slack else timers.fifos).get(lane)
        if fifo is not None:
            dues = fifo.dues
            if dues and dues[-1] > due:
                lane = None  # out of order
            elif len(dues) < fifo.limit and due >= timers.when:
                dues.append(due)  # the usual case, as in schedule()
                fifo.seqs.append(entry.seq)
                return entry
    timers.add(entry, lane, slack if lane is not None else 0.0)
    return entry


def cancel(entry: Deadline | None) -> None:
    """Cancel a deadline (a no-op for None or one that already fired)."""
    if entry is not None:
        entry.pending.pop(entry.seq, None)  # (the queue keeps no reference to the entry itself)
        entry.callback = None


def due(entry: Deadline) -> float:
    """The monotonic time at which ``entry`` falls (or fell) due."""
    return entry.due
