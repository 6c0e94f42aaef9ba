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

The breaker's state machine is :mod:`tierchain.breaker_state` (:func:`acquire` and
:func:`record`), so that every store runs the same rules (RedisStore runs a Lua
transcription of them); the sliding windows' arithmetic is :mod:`tierchain.windows`, the
suspect marks' rule :mod:`tierchain.suspects`, and :class:`MemoryStore` lives in
:mod:`tierchain.memory_store`. Every name of those modules a store's user needs is importable
from here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from .breaker_state import (
    PROBE_BUSY_RETRY,
    BreakerChange,
    BreakerPolicy,
    BreakerSnapshot,
    Ledger,
    Outcome,
    Ticket,
    acquire,
    failure_wait,
    record,
    reopen_cooldown,
    snapshot,
)
from .memory_store import AFFINITY_ENTRIES, NORMAL_ENTRIES, MemoryStore
from .suspects import SUSPECT_KEEP, Suspect, check_mark
from .windows import (
    USAGE_BOUND,
    WINDOW_BUCKETS,
    WindowCheck,
    WindowHold,
    refuses,
    room_in,
    window_sum,
)

__all__ = [
    "AFFINITY_ENTRIES",
    "NORMAL_ENTRIES",
    "PROBE_BUSY_RETRY",
    "SUSPECT_KEEP",
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
    "check_mark",
    "failure_wait",
    "record",
    "refuses",
    "reopen_cooldown",
    "room_in",
    "snapshot",
    "window_sum",
]


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
