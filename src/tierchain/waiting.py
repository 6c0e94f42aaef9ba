"""The waiting room: when every backend of a chain is full, a request waits at the gateway.

Without it, a request whose every tier is full goes to the chain's last backend
anyway and waits in that backend's own queue, where nothing can reorder it or
move it when another backend frees up ("no-regret scheduling": do not commit a
request to one replica's queue). With ``Failover(waiting_room=True)``, such a
request waits here instead:

- only on a route whose every backend can say it is full: each has a
  ``max_in_flight`` (its leases) or a ``status_url`` (its polled status);
- first come, first served within a priority band; with ``priority_header``
  set, a request names its band (``priority_bands``, highest first; one that
  names none, or an unknown one, is in the middle band);
- the first in line is let go the moment a lease of this process frees (and
  checks again every ``poll`` seconds, for a lease freed by another gateway
  process or a status that changed);
- released no faster than the backends admit: a request leaves the room only
  when a backend has room, and the one released does not wake the next in line
  (a lease given back does, or the next look); a burst of waiters never lands
  on a backend at once;
- bounded by the request's budget (a spent budget is the caller's 504, as
  anywhere), and by ``max_wait``: after that long, with every backend still
  full, the request is answered 503 with ``Retry-After`` (it is never sent on
  to a full backend);
- bounded in size: past ``max_waiting`` requests waiting in this process a new
  one gets 503 with ``Retry-After`` at once, and past ``key_share`` of that room
  held by one caller key (``tierchain.keys``), that key's new one gets 429;
- while it waits, ``{"state":"queued","position":N,...}`` state lines (and
  their keepalives) tell the caller where it stands.

``tierchain_waiting_room_requests{route}`` is how many wait now,
``tierchain_waiting_room_wait_seconds{route,outcome}`` how long each waited
(``released``, ``max_wait``, ``cancelled``) and
``tierchain_waiting_room_refused_total{route,reason}`` the requests turned away
(``full``, ``key_share``, ``max_wait``).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta

from ._checks import count, duration
from ._runtime import clock, deadlines
from .request import TierRequest
from .telemetry import WAITING_ROOM_REFUSED, WAITING_ROOM_REQUESTS, WAITING_ROOM_WAIT, labelled

__all__ = ["WaitRefused", "WaitingRoom"]


class WaitRefused(Exception):
    """The waiting room turns a request away: its answer's status, code, message and
    ``Retry-After`` seconds."""

    def __init__(self, status: int, code: str, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after


class _Waiter:
    __slots__ = ("event", "key")

    def __init__(self, band: int, seq: int) -> None:
        self.key = (band, seq)
        self.event = asyncio.Event()


class WaitingRoom:
    """One queue per route of requests waiting for a backend with room.

    ``bands`` are the priority bands, highest first; ``max_wait`` (seconds) is
    how long a request waits at most; ``poll`` how often the first in line
    checks again without being woken. ``max_waiting`` bounds the requests
    waiting in this process (every route), ``key_share`` the share of that
    bound one caller key may hold (0 < share <= 1; a request with no key is
    bounded only by the whole).
    """

    def __init__(
        self,
        *,
        bands: Sequence[str] = ("high", "normal", "low"),
        max_wait: float | timedelta,
        poll: float | timedelta,
        max_waiting: int = 256,
        key_share: float = 0.25,
    ) -> None:
        max_wait = duration("max_wait", max_wait)
        poll = duration("poll", poll)
        self.max_waiting = count("max_waiting", max_waiting, minimum=1)
        if (
            isinstance(key_share, bool)
            or not isinstance(key_share, int | float)
            or not 0 < key_share <= 1
        ):
            raise ValueError(f"key_share must be a number above 0 and at most 1, got {key_share!r}")
        self.per_key = max(1, math.floor(self.max_waiting * key_share))
        self._total = 0
        self._by_key: dict[str, int] = {}
        bands = tuple(bands)
        if not bands or not all(isinstance(b, str) and b for b in bands):
            raise ValueError(f"priority_bands must be non-empty names, got {bands!r}")
        self.bands = bands
        self._band_of = {b.lower(): i for i, b in enumerate(bands)}
        self.default_band = len(bands) // 2
        self.max_wait = float(max_wait)
        self.poll = float(poll)
        self._queues: dict[str, list[_Waiter]] = {}
        self._seq = itertools.count()

    def band(self, value: bytes | None) -> int:
        """The band a header value names (the middle one for none or an unknown name)."""
        if value is None:
            return self.default_band
        try:
            name = value.decode("ascii").strip().lower()
        except UnicodeDecodeError:
            return self.default_band
        return self._band_of.get(name, self.default_band)

    def waiting(self, route: str) -> int:
        """How many requests wait for ``route`` now."""
        return len(self._queues.get(route, ()))

    @property
    def retry_after(self) -> int:
        """The ``Retry-After`` (whole seconds) of a request turned away: a tenth of ``max_wait``."""
        return max(1, math.ceil(self.max_wait / 10))

    def _refuse(self, route: str, status: int, reason: str, message: str) -> WaitRefused:
        labelled(WAITING_ROOM_REFUSED, route, reason).inc()
        return WaitRefused(status, reason, message, self.retry_after)

    def notify(self) -> None:
        """A lease was given back: the first in line of every route looks again."""
        for queue in self._queues.values():
            queue[0].event.set()

    def _enter(self, route: str, band: int, key: str | None) -> tuple[list[_Waiter], _Waiter]:
        """A place in ``route``'s queue, in band order; WaitRefused when the room (or
        ``key``'s share of it) is full."""
        if self._total >= self.max_waiting:
            raise self._refuse(
                route, 503, "full", "every backend is full and the waiting room is full"
            )
        if key is not None and self._by_key.get(key, 0) >= self.per_key:
            raise self._refuse(
                route,
                429,
                "key_share",
                "every backend is full and this key already has its share of the waiting room",
            )
        self._total += 1
        if key is not None:
            self._by_key[key] = self._by_key.get(key, 0) + 1
        queue = self._queues.setdefault(route, [])
        waiter = _Waiter(band, next(self._seq))
        bisect.insort(queue, waiter, key=lambda w: w.key)
        return queue, waiter

    def _leave(
        self, route: str, queue: list[_Waiter], waiter: _Waiter, key: str | None, *, released: bool
    ) -> None:
        """``waiter`` leaves its queue, however its wait ended."""
        queue.remove(waiter)
        self._total -= 1
        if key is not None:
            left_for_key = self._by_key[key] - 1
            if left_for_key:
                self._by_key[key] = left_for_key
            else:
                del self._by_key[key]
        if queue:
            if not released:
                queue[0].event.set()  # the next in line looks at once
            # (one released takes the room it found: the next looks when a lease is
            # given back, or at its next look, never in the same breath)
        elif self._queues.get(route) is queue:
            del self._queues[route]

    async def wait(
        self,
        req: TierRequest,
        route: str,
        full: Callable[[], Awaitable[bool]],
        band: int,
        key: str | None = None,
    ) -> bool:
        """Wait while ``full()`` says every backend is full (or others are ahead).

        Returns True when the request waited, False when it went straight on;
        raises :class:`WaitRefused` when the room (or ``key``'s share of it) is
        full, or when ``max_wait`` ran out with every backend still full."""
        queue = self._queues.get(route)
        if not queue and not await full():
            return False
        queue, waiter = self._enter(route, band, key)
        gauge = labelled(WAITING_ROOM_REQUESTS, route)
        gauge.set(len(queue))
        started = clock.now()
        give_up = started + self.max_wait
        outcome = "cancelled"
        shown = 0
        timer: deadlines.Deadline | None = None
        try:
            while True:
                position = queue.index(waiter) + 1
                if position != shown:
                    shown = position
                    req.emit(
                        "queued",
                        position=position,
                        waiting=len(queue),
                        band=self.bands[band],
                        waited_s=round(clock.now() - started, 1),
                    )
                if position == 1 and not await full():
                    outcome = "released"
                    break
                left = give_up - clock.now()
                if left <= 0:
                    outcome = "max_wait"
                    break
                waiter.event.clear()
                timer = deadlines.schedule(
                    min(self.poll, left), waiter.event.set, fixed=left >= self.poll
                )
                await waiter.event.wait()
                deadlines.cancel(timer)
                timer = None
        finally:
            deadlines.cancel(timer)
            self._leave(route, queue, waiter, key, released=outcome == "released")
            gauge.set(len(queue))
            labelled(WAITING_ROOM_WAIT, route, outcome).observe(clock.now() - started)
        if outcome == "max_wait":
            raise self._refuse(
                route,
                503,
                "max_wait",
                f"every backend is still full after waiting {self.max_wait:g} s",
            )
        return True
