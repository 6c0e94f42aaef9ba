"""State shared between requests (and, with RedisStore, between replicas).

A store holds two kinds of state: breaker ledgers per (route, backend), and
operator pins per route. :class:`Store` is the protocol every store meets;
:class:`MemoryStore` is the embedded default that needs no service.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["BreakerSnapshot", "MemoryStore", "Store"]


@dataclass(frozen=True, slots=True)
class BreakerSnapshot:
    """One breaker's state as a reader (the operator page) sees it.

    ``state`` is ``"closed"``, ``"open"`` or ``"half_open"``; ``retry_in`` is the
    seconds until a probe may go (only while open, else None); ``failures`` and
    ``saturations`` are the consecutive counts of each ledger.
    """

    state: str
    retry_in: float | None
    failures: int
    saturations: int


@runtime_checkable
class Store(Protocol):
    """What Breaker and the pins need from a store. Times are wall-clock seconds."""

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


class MemoryStore:
    """The embedded default store: in this process only, no service needed."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._pins: dict[str, tuple[str, float]] = {}
        self._clock = clock

    async def set_pin(self, route: str, backend: str, ttl: float) -> float:
        expiry = time.time() + ttl
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
        return BreakerSnapshot("closed", None, 0, 0)
