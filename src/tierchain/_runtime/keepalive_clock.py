"""The keepalive timer: one ``TimerHandle`` per event loop for every waiting stream.

This stands in for a ``loop.call_at`` (or an ``asyncio.sleep`` in a task) per stream, as
sse-starlette's ``_ping`` has: thousands of streams waiting at once then cost one timer,
no task each and nothing per relayed chunk.

Every stream's next due time (its commit, its next keepalive) is queued under a sequence
number; ``pending`` maps the number to the stream until it is due or the stream ends. A
stream's first due time is always its start plus the same delay, so those go into a FIFO
per delay (O(1), in due order); later ones go into a heap. The queues hold only due times
and numbers (which the garbage collector never tracks): a stream that ended leaves nothing
behind but two numbers, dropped when they come up. A stream whose output moved its due
time later is simply queued again when the old time comes up.

The timer wakes at most every ``QUANTUM`` seconds, and calls what falls due within
``EARLY`` of a wake due then (its one tolerance): each stream's ``due(now)`` gets that
``now``, the tolerance already added.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import math
from collections.abc import Callable
from typing import Protocol

from .deadlines import Fifo

__all__ = ["EARLY", "QUANTUM", "Due", "KeepaliveClock"]

QUANTUM = 0.002  # the timer wakes at most this often; a line may be this late
EARLY = QUANTUM / 2  # what falls due this soon after a wake is due at it

_EMPTY_CONTEXT = contextvars.Context()  # the timer belongs to no request


class Due(Protocol):
    """What the timer holds: a stream with its number in the timer and its call."""

    entry: int | None

    def due(self, now: float) -> None: ...


class KeepaliveClock:
    """One event loop's keepalive timer. ``now``: the monotonic clock it reads;
    ``failed``: told of an exception one stream's ``due`` raised (the others still run)."""

    __slots__ = ("failed", "fifos", "handle", "heap", "loop", "now", "pending", "seq", "when")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        now: Callable[[], float],
        failed: Callable[[Exception], None],
    ) -> None:
        self.loop = loop
        self.now = now
        self.failed = failed
        self.fifos: dict[float, Fifo] = {}
        self.heap: list[tuple[float, int]] = []
        self.pending: dict[int, Due] = {}
        self.handle: asyncio.TimerHandle | None = None
        self.when = math.inf
        self.seq = 0

    def after(self, stream: Due, since: float, delay: float) -> int:
        """Schedule ``stream`` ``delay`` seconds after ``since`` (about now): its FIFO.

        ``since`` is the stream's start or its last output, so entries mostly come
        in due order; one earlier than the last queued goes to the heap instead.
        """
        fifo = self.fifos.get(delay)
        if fifo is None:
            fifo = self.fifos[delay] = Fifo()
        due = since + delay
        if fifo.dues and fifo.dues[-1] > due:
            return self.at(stream, due)
        seq = self.seq = self.seq + 1
        self.pending[seq] = stream
        fifo.push(due, seq, self.pending)
        if due < self.when:
            self._arm(due)
        return seq

    def at(self, stream: Due, due: float) -> int:
        """Schedule ``stream`` at ``due`` (monotonic seconds)."""
        seq = self.seq = self.seq + 1
        self.pending[seq] = stream
        heapq.heappush(self.heap, (due, seq))
        if due < self.when:
            self._arm(due)
        return seq

    def cancel(self, seq: int) -> None:
        """The stream queued under ``seq`` is no longer due then."""
        self.pending.pop(seq, None)

    def _arm(self, due: float) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.when = due
        delay = max(due - self.now(), QUANTUM)
        self.handle = self.loop.call_later(delay, self._fire, context=_EMPTY_CONTEXT)

    def _fire(self) -> None:
        self.handle = None
        self.when = math.inf
        now = self.now()
        upto = now + EARLY  # what falls due before the next wake is due now
        pending = self.pending
        due: list[Due] = []
        for fifo in self.fifos.values():
            for seq in fifo.pop_due(upto):
                stream = pending.pop(seq, None)
                if stream is not None:
                    due.append(stream)
        heap = self.heap
        while heap and heap[0][0] <= upto:
            stream = pending.pop(heapq.heappop(heap)[1], None)
            if stream is not None:
                due.append(stream)
        for stream in due:  # (what they schedule is for a later wake)
            stream.entry = None
            try:
                stream.due(upto)
            except Exception as exc:  # one stream's failure must not stop the others'
                self.failed(exc)
        while heap and heap[0][1] not in pending:
            heapq.heappop(heap)  # its stream ended: no need to wake for it
        nxt = heap[0][0] if heap else math.inf
        for fifo in self.fifos.values():
            nxt = min(nxt, fifo.next_due(pending))
        if nxt < math.inf and nxt < self.when:
            self._arm(max(nxt, now + QUANTUM))
