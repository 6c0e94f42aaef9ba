"""MemoryStore: the embedded default store, in this process only.

It implements every store protocol of :mod:`tierchain.store` on dicts, with the rules of
:mod:`tierchain.breaker_state` (the breaker), :mod:`tierchain.windows` (the sliding windows)
and :mod:`tierchain.suspects` (the suspect marks); :class:`~tierchain.RedisStore` mirrors it
rule for rule.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from ._checks import duration
from ._runtime import clock
from .breaker_state import (
    BreakerChange,
    BreakerPolicy,
    BreakerSnapshot,
    Ledger,
    Outcome,
    Ticket,
    acquire,
    record,
    snapshot,
)
from .suspects import SUSPECT_KEEP, Suspect, _Mark, check_mark
from .windows import WindowCheck, WindowHold, _bucket_of, refuses, room_in, window_sum

__all__ = ["AFFINITY_ENTRIES", "NORMAL_ENTRIES", "MemoryStore"]

NORMAL_ENTRIES = 4096
"""How many backends' normals (and suspect marks) a MemoryStore keeps (the oldest go first)."""

AFFINITY_ENTRIES = 65536
"""How many prefix entries a MemoryStore keeps (the least recently used go first)."""


class MemoryStore:
    """The embedded default store: in this process only, no service needed.

    ``clock`` is the breaker's clock (monotonic seconds; inject one in tests; default:
    the package's one clock, which :func:`tierchain.testing.virtual_time` switches).
    Every operation runs without yielding to the event loop, so each one is
    atomic with respect to every other request in the process.

    Options: [MemoryStore](stores.md#memorystore).
    """

    def __init__(self, *, clock: Callable[[], float] | None = None) -> None:
        self._pins: dict[str, tuple[str, float]] = {}
        self._ledgers: dict[tuple[str, str], Ledger] = {}
        self._leases: dict[str, dict[str, float]] = {}
        self._affinity: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()
        self._windows: dict[str, dict[int, int]] = {}
        self._totals: dict[str, int] = {}
        self._normals: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._facts: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()
        self._marks: dict[str, _Mark] = {}
        self._clock = clock

    def _now(self) -> float:
        """The store's clock now (the package's one clock unless one was given)."""
        return clock.now() if self._clock is None else self._clock()

    async def set_pin(self, route: str, backend: str, ttl: float) -> float:
        expiry = time.time() + duration("ttl", ttl)
        self._pins[route] = (backend, expiry)
        return expiry

    async def get_pin(self, route: str) -> str | None:
        pin = self._pins.get(route)
        if pin is None:
            return None
        if pin[1] <= time.time():
            del self._pins[route]
            return None
        return pin[0]

    async def list_pins(self) -> dict[str, tuple[str, float]]:
        now = time.time()
        for route in [r for r, (_, exp) in self._pins.items() if exp <= now]:
            del self._pins[route]
        return {route: (backend, exp - now) for route, (backend, exp) in self._pins.items()}

    async def delete_pin(self, route: str) -> bool:
        return self._pins.pop(route, None) is not None

    async def breaker_snapshot(self, route: str, backend: str) -> BreakerSnapshot:
        return snapshot(
            self._ledgers.get((route, backend)),
            self._now(),
        )

    async def breaker_acquire(
        self,
        route: str,
        backend: str,
        policy: BreakerPolicy,
        *,
        force: bool = False,
        wake: bool = False,
    ) -> Ticket:
        return self.breaker_acquire_now(route, backend, policy, force=force, wake=wake)

    def breaker_acquire_now(
        self,
        route: str,
        backend: str,
        policy: BreakerPolicy,
        *,
        force: bool = False,
        wake: bool = False,
    ) -> Ticket:
        """:meth:`breaker_acquire` without a coroutine: this store answers at once."""
        led = self._ledgers.get((route, backend))
        if led is None:
            if not force:
                return _CLOSED  # the common case allocates nothing
            led = self._ledgers[route, backend] = Ledger()
        return acquire(
            led,
            self._now(),
            policy,
            force=force,
            wake=wake,
        )

    async def breaker_record(
        self,
        route: str,
        backend: str,
        policy: BreakerPolicy,
        outcome: Outcome,
        *,
        gen: int,
        probe: int = 0,
        retry_after: float | None = None,
    ) -> BreakerChange:
        key = (route, backend)
        led = self._ledgers.get(key)
        if led is None:
            if outcome == "success" or outcome == "neutral":
                return _NOTHING
            led = self._ledgers[key] = Ledger()
        if outcome == "success" and self._marks:
            self._marks.pop(backend, None)  # it served again (a probe closed its breaker)
        # A ledger is never dropped: its gen must keep counting up.
        return record(
            led,
            self._now(),
            policy,
            outcome,
            gen=gen,
            probe=probe,
            retry_after=retry_after,
        )

    # -- in-flight leases ----------------------------------------------------

    def _live(self, backend: str) -> dict[str, float]:
        leases = self._leases.setdefault(backend, {})
        now = self._now()
        for token in [t for t, until in leases.items() if until <= now]:
            del leases[token]
        return leases

    async def lease_acquire(
        self, backend: str, token: str, limit: int, ttl: float, *, force: bool = False
    ) -> tuple[bool, int]:
        leases = self._live(backend)
        if len(leases) >= limit and not force:
            return False, len(leases)
        leases[token] = self._now() + ttl
        return True, len(leases)

    async def lease_renew(self, backend: str, tokens: list[str], ttl: float) -> None:
        leases = self._live(backend)
        until = self._now() + ttl
        for token in tokens:
            if token in leases:
                leases[token] = until

    async def lease_release(self, backend: str, token: str) -> None:
        leases = self._leases.get(backend)
        if leases is not None:
            leases.pop(token, None)

    async def lease_count(self, backend: str) -> int:
        return len(self._live(backend))

    # -- prefix affinity -----------------------------------------------------------

    async def affinity_get(self, route: str, keys: Sequence[str]) -> str | None:
        index = self._affinity
        now = clock.now()
        for key in keys:
            entry = index.get((route, key))
            if entry is None:
                continue
            if entry[1] <= now:
                del index[route, key]
                continue
            index.move_to_end((route, key))
            return entry[0]
        return None

    async def affinity_set(self, route: str, keys: Sequence[str], backend: str, ttl: float) -> None:
        index = self._affinity
        until = clock.now() + ttl
        for key in keys:
            index[route, key] = (backend, until)
            index.move_to_end((route, key))
        while len(index) > AFFINITY_ENTRIES:
            index.popitem(last=False)

    # -- windowed counters and usage totals ---------------------------------------

    async def window_admit(self, checks: Sequence[WindowCheck]) -> tuple[float, int] | None:
        return (await self.window_hold(checks)).refused

    async def window_hold(self, checks: Sequence[WindowCheck]) -> WindowHold:
        now = self._now()
        refused: tuple[float, int] | None = None
        used: list[int] = []
        reset: list[float] = []
        for i, check in enumerate(checks):
            total, first = window_sum(self._windows.get(check.name, {}), now, check.window)
            used.append(total)
            reset.append(room_in(first, now, check.window))
            if refuses(check, total) and (refused is None or reset[-1] > refused[0]):
                refused = (reset[-1], i)
        if refused is None:
            for i, check in enumerate(checks):
                if check.cost:
                    buckets = self._windows.setdefault(check.name, {})
                    bucket = _bucket_of(now, check.window)
                    buckets[bucket] = buckets.get(bucket, 0) + check.cost
                    used[i] += check.cost
        return WindowHold(refused, now, tuple(used), tuple(reset))

    async def usage_record(
        self,
        windows: Sequence[tuple[str, float, int]],
        totals: Sequence[tuple[str, int]],
        released: Sequence[tuple[str, float, int, float]] = (),
    ) -> None:
        now = self._now()
        for name, window, amount, at in released:
            buckets = self._windows.get(name)
            if buckets is not None:
                window_sum(buckets, now, window)  # drops what left the window
                bucket = _bucket_of(at, window)
                if bucket in buckets:
                    buckets[bucket] = max(0, buckets[bucket] - amount)
        for name, window, amount in windows:
            buckets = self._windows.setdefault(name, {})
            window_sum(buckets, now, window)  # drops what left the window
            bucket = _bucket_of(now, window)
            buckets[bucket] = buckets.get(bucket, 0) + amount
        for key, amount in totals:
            self._totals[key] = self._totals.get(key, 0) + amount

    async def window_sums(self, windows: Sequence[tuple[str, float]]) -> list[int]:
        now = self._now()
        return [window_sum(self._windows.get(n, {}), now, w)[0] for n, w in windows]

    async def usage_totals(self) -> dict[str, int]:
        return dict(self._totals)

    # -- learned normals and suspect marks ----------------------------------------

    async def normals_get(self, backend: str) -> str | None:
        return self.normals_get_now(backend)

    def normals_get_now(self, backend: str) -> str | None:
        """:meth:`normals_get` without a coroutine: this store answers at once."""
        entry = self._normals.get(backend)
        if entry is None:
            return None
        if entry[1] <= self._now():
            del self._normals[backend]
            return None
        return entry[0]

    async def normals_put(self, backend: str, value: str, ttl: float) -> None:
        normals = self._normals
        normals[backend] = (value, self._now() + ttl)
        normals.move_to_end(backend)
        while len(normals) > NORMAL_ENTRIES:
            normals.popitem(last=False)

    # -- facts found out about a backend ------------------------------------------------

    async def fact_get(self, backend: str, name: str) -> str | None:
        entry = self._facts.get((backend, name))
        if entry is None:
            return None
        if entry[1] <= self._now():
            del self._facts[(backend, name)]
            return None
        return entry[0]

    async def fact_put(self, backend: str, name: str, value: str, ttl: float) -> None:
        facts = self._facts
        facts[(backend, name)] = (value, self._now() + ttl)
        facts.move_to_end((backend, name))
        while len(facts) > NORMAL_ENTRIES:
            facts.popitem(last=False)

    async def suspect_check(self, backend: str, lease: float) -> Suspect | None:
        return self.suspect_check_now(backend, lease)

    def suspect_check_now(self, backend: str, lease: float) -> Suspect | None:
        """:meth:`suspect_check` without a coroutine: this store answers at once."""
        if not self._marks:
            return None  # the usual case: nothing marked, nothing read
        return check_mark(self._marks, backend, self._now(), lease)

    async def suspect_mark(self, backend: str, why: str, hold: float) -> None:
        self.suspect_mark_now(backend, why, hold)

    def suspect_mark_now(self, backend: str, why: str, hold: float) -> None:
        """:meth:`suspect_mark` without a coroutine."""
        now = self._now()
        marks = self._marks
        mark = marks.get(backend)
        strikes = 1 if mark is None or now >= mark.until + SUSPECT_KEEP else mark.strikes + 1
        marks[backend] = _Mark(now + hold, why, strikes)
        if len(marks) > NORMAL_ENTRIES:
            oldest = min(marks, key=lambda name: marks[name].until)
            del marks[oldest]

    async def suspect_end(self, backend: str, *, healthy: bool) -> None:
        self.suspect_end_now(backend, healthy=healthy)

    def suspect_end_now(self, backend: str, *, healthy: bool) -> None:
        """:meth:`suspect_end` without a coroutine."""
        if healthy:
            self._marks.pop(backend, None)
            return
        mark = self._marks.get(backend)
        if mark is not None:
            mark.probe_until = 0.0


_CLOSED = Ticket(True, "closed", clean=True)
_NOTHING = BreakerChange("closed", None, 0, 0)
