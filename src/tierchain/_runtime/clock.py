"""The one clock every layer reads, and the virtual time tests can put in its place.

``clock.now()`` stands in for ``time.monotonic()`` (and is that function, unwrapped,
until a test switches it): every deadline, window, gap and lease in the package is
measured with it, so that one switch moves them all. Read it as ``clock.now()``, never
bind it at import time (``from .clock import now`` would keep the real clock through a
switch). ``clock.wall()`` is epoch seconds, for the few times another process reads (a
Redis-shared store's pins and its fallback), never for a wait.

:class:`VirtualClock` is virtual time for tests, after looptime's idea: an event loop
(:meth:`VirtualClock.new_event_loop`) whose ``time()`` is the virtual clock, and whose
selector moves that clock straight to the next timer whenever the loop has nothing
else to do, with no real I/O ready after a short real grace. A test then runs as fast
as the machine lets it, and no busier machine makes a window close early: time only
passes while every coroutine is waiting. Real I/O across loopback sockets still flows
(a peer in the same loop writes, the data is readable at once); a peer in another
process gets ``grace`` of real time per idle turn, so subprocess servers do not belong
in a virtual-time test.
"""

from __future__ import annotations

import asyncio
import functools
import selectors
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

__all__ = ["VirtualClock", "now", "virtual", "virtual_time", "wall"]

now: Callable[[], float] = time.monotonic
"""Monotonic seconds: ``time.monotonic`` itself, or a :class:`VirtualClock`'s ``read``."""

wall: Callable[[], float] = time.time
"""Wall-clock (epoch) seconds, for a time another process must read: a pin's expiry as an
operator sees it, the breaker times a Redis-shared store keeps when Redis is away (Redis's
own ``TIME`` is epoch seconds, and two gateways' monotonic clocks share no origin). Never
for a wait: every wait is on :data:`now`. Virtual time does not switch it."""


_switched: list[tuple[object, VirtualClock]] = []  # the virtual_time blocks open, oldest first


class VirtualClock:
    """Virtual monotonic seconds, moved by the event loops it makes (or by :meth:`advance`).

    ``start`` is the first reading (a round number, so that whole seconds add up
    exactly); ``grace`` is the real time an idle loop waits for real I/O before it jumps
    to its next timer.
    """

    __slots__ = ("grace", "jumps", "read", "reading")

    def __init__(self, *, start: float = 1_000_000.0, grace: float = 0.002) -> None:
        self.reading = float(start)
        self.grace = grace
        self.jumps = 0  # how many times an idle loop moved the clock on
        # What :data:`now` becomes while this clock is switched on: the reading, with no
        # Python frame (as ``time.monotonic`` has none), so that a count of instructions
        # on virtual time charges a clock read what the real clock costs, not a call.
        self.read: Callable[[], float] = functools.partial(getattr, self, "reading")

    def __call__(self) -> float:
        return self.reading

    def advance(self, seconds: float) -> None:
        """Move the clock on by hand (timers then due run on the loop's next turn)."""
        if seconds < 0:
            raise ValueError(f"a clock goes forward only, got {seconds!r}")
        self.reading += seconds

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        """An event loop on this clock, for ``asyncio.Runner(loop_factory=...)``."""
        return _VirtualLoop(self)


class _IdleJumps(selectors.BaseSelector):
    """A selector that, when nothing is ready, moves the clock to the loop's next timer."""

    def __init__(self, clock: VirtualClock) -> None:
        self._inner = selectors.DefaultSelector()
        self._clock = clock

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.modify(fileobj, events, data)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._inner.get_map()

    def close(self) -> None:
        self._inner.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        inner = self._inner
        if timeout is not None and timeout <= 0:
            return inner.select(0)
        ready = inner.select(0)
        if ready:
            return ready
        clock = self._clock
        wait = clock.grace if timeout is None else min(timeout, clock.grace)
        ready = inner.select(wait)  # real I/O from a thread or another process
        if ready:
            return ready
        if timeout is None:
            return inner.select(None)  # no timer at all: only real I/O can come
        clock.reading += timeout  # idle until the next timer: it is due now
        clock.jumps += 1
        return []


class _VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(_IdleJumps(clock))
        self._virtual = clock

    def time(self) -> float:
        return self._virtual.reading


@contextmanager
def virtual_time(clock: VirtualClock | None = None) -> Iterator[VirtualClock]:
    """Switch :func:`now` to a :class:`VirtualClock` for the ``with`` block, then back.

    Run the code under test on ``clock.new_event_loop()`` inside the block, so that the
    loop's timers and the package's readings are the same clock.
    """
    global now
    clock = VirtualClock() if clock is None else clock
    entry = (object(), clock)  # this block's own entry (one clock may be switched on twice)
    _switched.append(entry)
    now = clock.read
    try:
        yield clock
    finally:
        # Blocks may close in any order: the clock in force is the latest block still
        # open, and the real one once none is (never one already closed).
        _switched.remove(entry)
        now = _switched[-1][1].read if _switched else time.monotonic


def virtual() -> VirtualClock | None:
    """The virtual clock switched on (the latest :func:`virtual_time` block open), if any."""
    return _switched[-1][1] if _switched else None
