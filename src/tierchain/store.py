"""State shared between requests (and, with RedisStore, between replicas).

A store holds these kinds of state: breaker ledgers per (route, backend),
operator pins per route, in-flight leases per backend (for
``Backend(max_in_flight=N)``; see :mod:`tierchain.admission`), windowed
counters with usage totals (per-key limits and token accounting; see
:mod:`tierchain.limits`), and the watchdog's per-backend learned normals and
suspect marks (:class:`NormalStore`; see :mod:`tierchain.learned`). :class:`Store` is
the protocol every store meets; :class:`MemoryStore` is the embedded default
that needs no service, and :class:`~tierchain.RedisStore` shares the same
semantics between replicas.

The breaker's state machine lives here, in :func:`acquire` and :func:`record`,
so that every store runs the same rules (RedisStore runs a Lua transcription of
them). Per (route, backend) a ledger holds:

- ``state``: ``closed``, ``open`` or ``half_open`` (an open breaker whose
  cooldown has ended becomes half-open the next time anyone looks);
- two consecutive counts, ``failures`` and ``saturations``, cleared by one
  good attempt;
- ``open_until`` (the store's clock), the probe slot (``probe_until`` and the
  token of the probe holding it), and ``gen``, bumped every time the breaker
  opens, so that a verdict from an attempt admitted before the breaker opened
  can neither close it nor extend its cooldown.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from ._checks import duration
from ._runtime import clock

__all__ = [
    "AFFINITY_ENTRIES",
    "USAGE_BOUND",
    "WINDOW_BUCKETS",
    "AffinityStore",
    "BreakerChange",
    "BreakerPolicy",
    "BreakerSnapshot",
    "FactStore",
    "LeaseStore",
    "Ledger",
    "MemoryStore",
    "NormalStore",
    "Outcome",
    "Store",
    "Suspect",
    "Ticket",
    "UsageStore",
    "WindowCheck",
    "WindowHold",
    "acquire",
    "failure_wait",
    "record",
    "snapshot",
]

Outcome = Literal["success", "failure", "stream_failure", "saturation", "neutral"]
"""How an attempt ended, for the breaker. ``stream_failure`` is a failure of a
stream that had already reached the caller (it broke or stalled mid-answer): it
counts as a failure and, on a ledger of its own, against
``stream_failure_threshold``. ``neutral`` counts for nothing and only gives
back a probe slot (a 4xx, a cancelled attempt, a spent budget)."""

PROBE_BUSY_RETRY = 1.0
"""``retry_in`` reported while another request holds the half-open probe slot."""


@dataclass(frozen=True, slots=True)
class BreakerSnapshot:
    """One breaker's state as a reader (the operator page) sees it.

    ``state`` is ``"closed"``, ``"open"`` or ``"half_open"``; ``retry_in`` is the
    seconds until a probe may go (only while open, else None); ``failures`` and
    ``saturations`` are the consecutive counts of each ledger; ``reason`` says what
    opened it, while open (``failure``, ``stream_failure``, ``saturation``,
    ``retry_after``; ``""`` otherwise).
    """

    state: str
    retry_in: float | None
    failures: int
    saturations: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    """The numbers a Breaker runs its ledgers with (passed to the store per call)."""

    failure_threshold: int = 5
    failure_cooldown: float = 30.0
    saturation_threshold: int = 2
    saturation_cooldown: float = 900.0
    retry_after_cap: float = 900.0
    probe_lease: float = 300.0
    saturation_backoff: float = 30.0
    """The first cooldown after a half-open probe saturated; it doubles with each
    further re-open, up to ``saturation_cooldown`` (0: always ``saturation_cooldown``)."""
    stream_failure_threshold: int = 2
    """Mid-stream deaths in a row (``stream_failure``) that open the breaker."""
    probe_every: float = 0.0
    """The base of a failure's cooldown: a breaker opened by failures half-opens (its
    recovery probe goes) this long after it opened, and each further failed probe waits one
    ``probe_every`` longer (2, 4, 6 ... s for 2 s), up to ``failure_cooldown`` (Envoy's
    outlier ejection: base ejection time times the ejections in a row, capped). 0: every
    open for failures lasts ``failure_cooldown`` (the Breaker's default is 2 s)."""


@dataclass(frozen=True, slots=True)
class Ticket:
    """The answer to "may this attempt go?".

    ``probe`` is the probe token (0 when this attempt is not the half-open
    probe); hand it and ``gen`` back to :meth:`Store.breaker_record`.
    ``transitions`` lists the states this call moved the breaker into.
    ``clean`` says the breaker was closed with both counts at zero, so a
    success has nothing to clear and need not be recorded. ``reason`` says,
    for a breaker that turned the attempt away (open, or half-open with its probe
    out), what last opened it (``failure``, ``saturation``, ``retry_after``; ``""``
    otherwise).
    """

    admitted: bool
    state: str
    gen: int = 0
    probe: int = 0
    retry_in: float | None = None
    transitions: tuple[str, ...] = ()
    clean: bool = False
    reason: str = ""


@dataclass(frozen=True, slots=True)
class BreakerChange:
    """The breaker after an outcome was recorded; ``reason`` says what opened it."""

    state: str
    retry_in: float | None
    failures: int
    saturations: int
    transitions: tuple[str, ...] = ()
    reason: str = ""


@dataclass(slots=True)
class Ledger:
    """The mutable state of one breaker (see the module docstring)."""

    state: str = "closed"
    failures: int = 0
    saturations: int = 0
    open_until: float = 0.0
    probe_until: float = 0.0
    probe_token: int = 0
    gen: int = 0
    reason: str = ""
    reopens: int = 0  # failed probes since the breaker last closed (the backoff's step)
    stream_failures: int = 0


def reopen_cooldown(policy: BreakerPolicy, reopens: int) -> float:
    """The cooldown of a breaker re-opened by a saturated probe, after ``reopens`` earlier ones."""
    if policy.saturation_backoff <= 0:
        return policy.saturation_cooldown
    return min(policy.saturation_cooldown, policy.saturation_backoff * 2.0 ** min(reopens, 60))


def failure_wait(policy: BreakerPolicy, reopens: int) -> float:
    """The cooldown of a breaker opened by failures after ``reopens`` failed probes in a row:
    ``probe_every`` times the opens in the streak, capped at ``failure_cooldown``."""
    if policy.probe_every <= 0:
        return policy.failure_cooldown
    return min(policy.failure_cooldown, policy.probe_every * (reopens + 1))


def _settle_time(led: Ledger, now: float, transitions: list[str]) -> None:
    if led.state == "open" and now >= led.open_until:
        led.state = "half_open"
        transitions.append("half_open")


def acquire(
    led: Ledger, now: float, policy: BreakerPolicy, *, force: bool = False, wake: bool = False
) -> Ticket:
    """May an attempt go now? Takes the probe slot when half-open and free.

    ``wake`` says the backend's status reports idle: a breaker open for
    saturation ends its cooldown now (and this attempt may be its probe).
    """
    transitions: list[str] = []
    if wake and led.state == "open" and led.reason == "saturation" and now < led.open_until:
        led.open_until = now
    _settle_time(led, now, transitions)
    done = tuple(transitions)
    if led.state == "closed" or force:
        clean = led.state == "closed" and not led.failures and not led.saturations
        return Ticket(True, led.state, led.gen, 0, None, done, clean)
    if led.state == "half_open":
        if led.probe_until <= now:
            led.probe_token += 1
            led.probe_until = now + policy.probe_lease
            return Ticket(True, "half_open", led.gen, led.probe_token, None, done)
        # (The reason it last opened: callers skipped while a probe after a backend's
        # own Retry-After is out still hear 429, as while it cooled down.)
        return Ticket(False, "half_open", led.gen, 0, PROBE_BUSY_RETRY, done, reason=led.reason)
    return Ticket(False, "open", led.gen, 0, led.open_until - now, done, reason=led.reason)


def record(
    led: Ledger,
    now: float,
    policy: BreakerPolicy,
    outcome: Outcome,
    *,
    gen: int,
    probe: int = 0,
    retry_after: float | None = None,
) -> BreakerChange:
    """Apply one attempt's outcome to the ledger."""
    transitions: list[str] = []
    _settle_time(led, now, transitions)
    if probe and probe == led.probe_token:
        led.probe_until = 0.0
    fresh = gen == led.gen
    if outcome == "success":
        if fresh:
            led.failures = led.saturations = led.stream_failures = 0
            if led.state != "closed":
                led.state = "closed"
                led.open_until = led.probe_until = 0.0
                led.reason = ""
                led.reopens = 0
                transitions.append("closed")
    elif outcome == "failure" or outcome == "stream_failure" or outcome == "saturation":
        if outcome != "saturation":
            led.failures += 1
            kind_cooldown = failure_wait(policy, 0)
            tripped = led.failures >= policy.failure_threshold
            if outcome == "stream_failure":
                led.stream_failures += 1
                streams = led.stream_failures >= policy.stream_failure_threshold
                if not tripped and streams:
                    tripped = True
                else:
                    outcome = "failure"  # (the reason: the failures' own threshold)
        else:
            led.saturations += 1
            kind_cooldown = policy.saturation_cooldown
            tripped = led.saturations >= policy.saturation_threshold
        cooldown = kind_cooldown if tripped else 0.0
        reason: str = outcome
        hinted = 0.0
        if retry_after is not None:
            hinted = min(retry_after, policy.retry_after_cap)
            if not tripped or hinted > cooldown:
                reason = "retry_after"
            tripped = True
            cooldown = max(cooldown, hinted)
        if led.state != "closed":
            # The probe (or a forced attempt) failed: re-open. A verdict from an
            # attempt admitted before the breaker opened is counted, nothing more.
            tripped = fresh
            # Re-opens grow: one slow probe after a hiccup must not cost the whole
            # saturation cooldown (it doubles from saturation_backoff), and a failed
            # probe waits one probe_every longer than the last (Envoy's ejection backoff).
            if outcome == "saturation":
                cooldown = max(hinted, reopen_cooldown(policy, led.reopens))
            else:
                cooldown = max(hinted, failure_wait(policy, led.reopens + 1))
            if fresh:
                led.reopens += 1
        if tripped:
            if led.state != "open":
                led.gen += 1
                led.probe_until = 0.0
                transitions.append("open")
            led.state = "open"
            if now + cooldown > led.open_until:
                led.open_until = now + cooldown
                led.reason = reason
    return BreakerChange(
        led.state,
        led.open_until - now if led.state == "open" else None,
        led.failures,
        led.saturations,
        tuple(transitions),
        led.reason,
    )


def snapshot(led: Ledger | None, now: float) -> BreakerSnapshot:
    """What a reader sees, without changing anything."""
    if led is None:
        return BreakerSnapshot("closed", None, 0, 0)
    state = led.state
    if state == "open" and now >= led.open_until:
        state = "half_open"
    if state != "open":
        return BreakerSnapshot(state, None, led.failures, led.saturations)
    return BreakerSnapshot(state, led.open_until - now, led.failures, led.saturations, led.reason)


@runtime_checkable
class Store(Protocol):
    """What Breaker and the pins need from a store.

    Pin expiries are wall-clock (epoch) seconds; breaker times are seconds on
    the store's clock.
    """

    async def set_pin(self, route: str, backend: str, ttl: float) -> float:
        """Pin ``route`` to ``backend`` for ``ttl`` seconds; returns the expiry (epoch s)."""
        ...

    async def get_pin(self, route: str) -> str | None:
        """The backend ``route`` is pinned to, or None (also once the pin expired)."""
        ...

    async def list_pins(self) -> dict[str, tuple[str, float]]:
        """Every live pin: route -> (backend, seconds remaining)."""
        ...

    async def delete_pin(self, route: str) -> bool:
        """Remove ``route``'s pin; True when there was one."""
        ...

    async def breaker_snapshot(self, route: str, backend: str) -> BreakerSnapshot:
        """The breaker state of (``route``, ``backend``); closed when never seen."""
        ...

    async def breaker_acquire(
        self,
        route: str,
        backend: str,
        policy: BreakerPolicy,
        *,
        force: bool = False,
        wake: bool = False,
    ) -> Ticket:
        """One atomic step before an attempt: may it go, and is it the probe?

        ``wake``: the backend's status reports idle, so a breaker open for
        saturation may half-open now.
        """
        ...

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
        """One atomic step after an attempt: apply its outcome, give back its probe slot."""
        ...


@runtime_checkable
class LeaseStore(Protocol):
    """What in-flight admission needs from a store: leases that run out on their own.

    A lease is one attempt in flight at a backend. It lasts ``ttl`` seconds
    unless renewed, so the count held by a replica that died runs out by
    itself. Times are seconds on the store's clock.
    """

    async def lease_acquire(
        self, backend: str, token: str, limit: int, ttl: float, *, force: bool = False
    ) -> tuple[bool, int]:
        """Take a lease when fewer than ``limit`` are live (always, with ``force``).

        Returns (taken, live leases after the call).
        """
        ...

    async def lease_renew(self, backend: str, tokens: list[str], ttl: float) -> None:
        """Extend the live leases ``tokens`` to ``ttl`` seconds from now."""
        ...

    async def lease_release(self, backend: str, token: str) -> None:
        """Give a lease back (nothing happens when it already ran out)."""
        ...

    async def lease_count(self, backend: str) -> int:
        """How many leases on ``backend`` are live."""
        ...


@runtime_checkable
class AffinityStore(Protocol):
    """What prefix affinity needs from a store: which replica served a prompt prefix.

    ``keys`` are the hashes of a request's prompt prefixes (see
    :mod:`tierchain.picker`); an entry lives ``ttl`` seconds from its last write.
    """

    async def affinity_get(self, route: str, keys: Sequence[str]) -> str | None:
        """The replica recorded for the first of ``keys`` that has one, or None."""
        ...

    async def affinity_set(self, route: str, keys: Sequence[str], backend: str, ttl: float) -> None:
        """Record ``backend`` as the replica that served each of ``keys``."""
        ...


WINDOW_BUCKETS = 60
"""A windowed counter keeps its window in this many buckets: a window of 60 s counts per
second, a day's in 24-minute buckets; an amount leaves the window with its bucket."""


USAGE_BOUND = 2**31
"""The most any one amount a store is given may be (tokens of one request, a cost in
nano-units): :mod:`tierchain.limits` bounds every number from outside (an upstream's usage,
a caller's ``max_tokens``) to it before it is stored. No model's context holds a
thousandth of it, and sums of such amounts stay exact in Lua's doubles (2^53) and in
Redis's 64-bit integers for millions of requests per bucket."""


@dataclass(frozen=True, slots=True)
class WindowCheck:
    """One limit to check on admission: the counter ``name`` summed over the last
    ``window`` seconds must stay within ``limit`` once ``cost`` is added (with
    ``cost`` 0: must be below ``limit``). With ``fits`` False the counter must only
    be below ``limit`` and the cost may take it past: a reservation, where the
    request admitted last may overrun the limit by its own amount, never more."""

    name: str
    window: float
    limit: int
    cost: int = 0
    fits: bool = True


@dataclass(frozen=True, slots=True)
class WindowHold:
    """The answer of :meth:`UsageStore.window_hold`.

    ``refused``: None when every check passed and the costs were added, else the
    seconds until the failing counters have room and the index of the check that
    needs the longest. ``at``: the store's time the costs were added at (hand it
    back to :meth:`UsageStore.usage_record` as ``released`` to take them out of
    their own bucket). ``used``: each counter's sum now (after the costs, when
    added); ``reset``: the seconds until each counter's oldest amount leaves its
    window (the window's length when it holds nothing).
    """

    refused: tuple[float, int] | None
    at: float
    used: tuple[int, ...]
    reset: tuple[float, ...]


def refuses(check: WindowCheck, total: int) -> bool:
    """Does a counter that holds ``total`` refuse ``check``?"""
    if check.cost and check.fits:
        return total + check.cost > check.limit
    return total >= check.limit


@runtime_checkable
class UsageStore(Protocol):
    """What per-key limits and usage accounting need from a store: counters summed over
    a sliding window (in :data:`WINDOW_BUCKETS` buckets), and running totals.

    Counter names and total fields are opaque strings chosen by :mod:`tierchain.limits`.
    """

    async def window_admit(self, checks: Sequence[WindowCheck]) -> tuple[float, int] | None:
        """Atomically: when every check passes, add each ``cost`` and return None; else
        add nothing and return the seconds until the failing counters have room, and the
        index of the check that needs the longest."""
        ...

    async def window_hold(self, checks: Sequence[WindowCheck]) -> WindowHold:
        """:meth:`window_admit` that also says when (``at``) the costs were added and
        what each counter holds (see :class:`WindowHold`): a reservation to release later."""
        ...

    async def usage_record(
        self,
        windows: Sequence[tuple[str, float, int]],
        totals: Sequence[tuple[str, int]],
        released: Sequence[tuple[str, float, int, float]] = (),
    ) -> None:
        """Add each (name, window, amount) to its windowed counter and each (field,
        amount) to the running totals; first take each (name, window, amount, at) of
        ``released`` out of the bucket it was held in at ``at`` (nothing when that
        bucket has left the window; never below zero)."""
        ...

    async def window_sums(self, windows: Sequence[tuple[str, float]]) -> list[int]:
        """Each (name, window) counter's sum over its window now."""
        ...

    async def usage_totals(self) -> dict[str, int]:
        """Every running total: field -> amount."""
        ...


def _bucket_of(now: float, window: float) -> int:
    return int(now // (window / WINDOW_BUCKETS))


def window_sum(buckets: dict[int, int], now: float, window: float) -> tuple[int, int | None]:
    """Drop the buckets that left ``window``; the sum of the rest, and the oldest non-empty one."""
    oldest = _bucket_of(now, window) - WINDOW_BUCKETS + 1
    total = 0
    first: int | None = None
    for bucket in [b for b in buckets if b < oldest]:
        del buckets[bucket]
    for bucket, amount in buckets.items():
        total += amount
        if amount and (first is None or bucket < first):
            first = bucket
    return total, first


def room_in(first: int | None, now: float, window: float) -> float:
    """Seconds until the oldest non-empty bucket ``first`` leaves the window."""
    if first is None:
        return window
    width = window / WINDOW_BUCKETS
    return max(0.001, (first + WINDOW_BUCKETS) * width - now)


@dataclass(frozen=True, slots=True)
class Suspect:
    """A backend a caller's attempt was judged on (too slow, stalled, broke mid-stream).

    ``why`` is the verdict; ``retry_in`` the seconds until one caller may try it again
    (0 for that caller: ``probe`` is True, and only it goes until its verdict); ``strikes``
    counts the verdicts in a row (the Breaker's ledgers, not the mark, grow the wait).
    """

    why: str
    retry_in: float
    probe: bool = False
    strikes: int = 1


@runtime_checkable
class FactStore(Protocol):
    """What Failover remembers of a backend through a store: short facts found out about
    it (an opaque string per backend and name: whether it continues a trailing assistant
    message, see :mod:`tierchain.prefill`). Times are seconds."""

    async def fact_get(self, backend: str, name: str) -> str | None:
        """The fact ``name`` of ``backend`` as last written, or None (never, or expired)."""
        ...

    async def fact_put(self, backend: str, name: str, value: str, ttl: float) -> None:
        """Write the fact ``name`` of ``backend``, kept ``ttl`` seconds from now."""
        ...


SUSPECT_KEEP = 600.0
"""Seconds a suspect mark's strikes are remembered after its hold ended, with no verdict."""


@runtime_checkable
class NormalStore(Protocol):
    """What the watchdog shares through a store: each backend's learned normals (an
    opaque string, see :class:`~tierchain.learned.SharedNormals`) and suspect marks.

    Times are seconds on the store's clock.
    """

    async def normals_get(self, backend: str) -> str | None:
        """``backend``'s learned normals as last written, or None (never, or expired)."""
        ...

    async def normals_put(self, backend: str, value: str, ttl: float) -> None:
        """Write ``backend``'s learned normals, kept ``ttl`` seconds from now."""
        ...

    async def suspect_check(self, backend: str, lease: float) -> Suspect | None:
        """None when ``backend`` is not suspect. Otherwise the mark; once its hold is over,
        the first caller to ask takes the probe slot (for ``lease`` seconds at most)."""
        ...

    async def suspect_mark(self, backend: str, why: str, hold: float) -> None:
        """A verdict on ``backend``: mark it suspect for ``hold`` seconds (a strike more)."""
        ...

    async def suspect_end(self, backend: str, *, healthy: bool) -> None:
        """An attempt let through a mark ended: ``healthy`` drops the mark, otherwise (no
        verdict either way) the probe slot is given back."""
        ...


@dataclass(slots=True)
class _Mark:
    until: float
    why: str
    strikes: int = 1
    probe_until: float = 0.0


def check_mark(marks: dict[str, _Mark], backend: str, now: float, lease: float) -> Suspect | None:
    """:meth:`NormalStore.suspect_check` on a dict of marks (RedisStore runs it in Lua)."""
    mark = marks.get(backend)
    if mark is None:
        return None
    if now >= mark.until + SUSPECT_KEEP:
        del marks[backend]
        return None
    if now < mark.until:
        return Suspect(mark.why, mark.until - now, False, mark.strikes)
    if mark.probe_until > now:
        return Suspect(mark.why, mark.probe_until - now, False, mark.strikes)
    mark.probe_until = now + lease
    return Suspect(mark.why, 0.0, True, mark.strikes)


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
            (clock.now() if self._clock is None else self._clock()),
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
            (clock.now() if self._clock is None else self._clock()),
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
            (clock.now() if self._clock is None else self._clock()),
            policy,
            outcome,
            gen=gen,
            probe=probe,
            retry_after=retry_after,
        )

    # -- in-flight leases ----------------------------------------------------

    def _live(self, backend: str) -> dict[str, float]:
        leases = self._leases.setdefault(backend, {})
        now = clock.now() if self._clock is None else self._clock()
        for token in [t for t, until in leases.items() if until <= now]:
            del leases[token]
        return leases

    async def lease_acquire(
        self, backend: str, token: str, limit: int, ttl: float, *, force: bool = False
    ) -> tuple[bool, int]:
        leases = self._live(backend)
        if len(leases) >= limit and not force:
            return False, len(leases)
        leases[token] = (clock.now() if self._clock is None else self._clock()) + ttl
        return True, len(leases)

    async def lease_renew(self, backend: str, tokens: list[str], ttl: float) -> None:
        leases = self._live(backend)
        until = (clock.now() if self._clock is None else self._clock()) + ttl
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
        now = clock.now() if self._clock is None else self._clock()
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
        now = clock.now() if self._clock is None else self._clock()
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
        now = clock.now() if self._clock is None else self._clock()
        return [window_sum(self._windows.get(n, {}), now, w)[0] for n, w in windows]

    async def usage_totals(self) -> dict[str, int]:
        return dict(self._totals)

    # -- learned normals and suspect marks ----------------------------------------

    def _now(self) -> float:
        return clock.now() if self._clock is None else self._clock()

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
