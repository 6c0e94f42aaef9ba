"""Items each due a fixed delay after they were queued, under one loop timer per loop.

This stands in for a ``loop.call_later(delay, ...)`` per item (the disconnect guards'
``WATCH_AFTER``, per request): most items are discarded long before they are due (a request
answered within 20 ms), and asyncio's timer handles would cost each of them a heap entry and
a context copy. Items come in due order, so a :class:`~.deadlines.Fifo` holds them in O(1);
``pending`` maps a number to its item until it is due or discarded, so the queue keeps no
discarded item alive. The one timer is armed only while the queue is not empty. Its
tolerance is the loop's (:func:`.loops.slack`), as the deadlines'.

It keeps its own loop timer rather than riding on :mod:`.deadlines`: measured with callgrind
over ``bench/layers.py``, the whole stack cost about 9 k more instructions a request when
this queue's wake-ups went through the deadlines (each moved the deadlines' timer earlier).
"""

from __future__ import annotations

import asyncio
import math
from typing import Protocol

from . import clock
from .deadlines import Fifo
from .loops import slack

__all__ = ["Due", "Later"]


class Due(Protocol):
    """What the queue holds: an item told when it falls due."""

    def due_now(self) -> None: ...


class Later:
    """One event loop's queue of items due ``delay`` seconds after :meth:`add`."""

    __slots__ = ("armed", "delay", "failure", "fifo", "loop", "pending", "seq", "slack")

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float, failure: str) -> None:
        self.loop = loop
        self.delay = delay
        self.failure = failure  # the message for an item whose due_now raised
        self.slack = slack(loop)  # how early a loop timer may fire
        self.fifo = Fifo()
        self.pending: dict[int, Due] = {}
        self.seq = 0
        self.armed = False

    def add(self, item: Due) -> int:
        """Queue ``item``; returns its number (for :meth:`discard`)."""
        seq = self.seq = self.seq + 1
        self.pending[seq] = item
        self.fifo.push(clock.now() + self.delay, seq, self.pending)
        if not self.armed:
            self.armed = True
            self.loop.call_later(self.delay, self._tick)
        return seq

    def discard(self, seq: int) -> None:
        """The item queued under ``seq`` is no longer wanted (a no-op once it was due)."""
        self.pending.pop(seq, None)

    def _tick(self) -> None:
        pending = self.pending
        for seq in self.fifo.pop_due(clock.now() + self.slack):
            item = pending.pop(seq, None)
            if item is not None:
                try:
                    item.due_now()
                except Exception as exc:  # one broken item must not stop the others
                    self.loop.call_exception_handler({"message": self.failure, "exception": exc})
        nxt = self.fifo.next_due(pending)  # (items discarded meanwhile: no need to wake)
        if nxt < math.inf:
            self.loop.call_later(max(0.0, nxt - clock.now()), self._tick)
        else:
            self.armed = False
