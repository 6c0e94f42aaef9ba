"""In-flight admission: never send a backend more attempts than it has room for.

``Backend(max_in_flight=N)`` caps the attempts in flight at that backend,
counted across every replica that shares the store. Each admitted attempt
holds a *lease* in the store for as long as it runs; the lease lasts ``lease``
seconds and this process renews its live leases every third of that, so the
count a dead replica held runs out by itself within ``lease`` seconds.

An attempt that finds the backend full is not sent: :class:`Admission` raises
:class:`~tierchain.errors.BackendBusy` and Failover moves to the next tier at
once. The chain's last tier is never skipped for being full: its attempt takes
a lease anyway and queues at the backend, as it would without a limit. Busy is
not a failure: no breaker ledger hears of it.

A store that cannot be reached never blocks an attempt: the store falls back
to local memory (RedisStore) or, for any other error, the attempt goes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import secrets
from datetime import timedelta

from ._checks import duration
from ._runtime import clock
from .backend import Backend
from .errors import BackendBusy
from .store import LeaseStore, MemoryStore
from .telemetry import BACKEND_IN_FLIGHT, labelled, log_event

__all__ = ["Admission", "Lease"]

_WARN_EVERY = 60.0


class Lease:
    """One admitted attempt's place at a backend; give it back with :meth:`Admission.leave`."""

    __slots__ = ("backend", "in_flight", "token")

    def __init__(self, backend: str, token: str, in_flight: int) -> None:
        self.backend = backend
        self.token = token
        self.in_flight = in_flight


class Admission:
    """Count attempts in flight per backend through ``store``; refuse the one too many.

    ``store`` is any store with leases (:class:`~tierchain.MemoryStore`,
    :class:`~tierchain.RedisStore`); None keeps the count in this process only.
    ``lease`` is how long a lease lives without renewal (how soon a dead
    replica's count runs out).
    """

    def __init__(self, store: object = None, *, lease: float | timedelta = 30.0) -> None:
        lease = duration("lease", lease)
        # A custom store without leases counts in this process.
        self.store: LeaseStore = store if isinstance(store, LeaseStore) else MemoryStore()
        self.lease = float(lease)
        self._prefix = f"{os.getpid()}-{secrets.token_hex(4)}-"
        self._ids = itertools.count(1)
        self._live: dict[str, set[str]] = {}
        self._renewer: asyncio.Task[None] | None = None
        self._warned = -math.inf

    async def enter(self, backend: Backend, *, last: bool) -> Lease | None:
        """Take a lease on ``backend`` (None when it has no limit); BackendBusy when full."""
        limit = backend.max_in_flight
        if limit is None:
            return None
        name = backend.name
        lease, live = await self.take(name, limit, force=last)
        if lease is None and live:
            raise BackendBusy(
                f"backend {name!r} has {live} attempts in flight (max_in_flight={limit})",
                in_flight=live,
            )
        if lease is not None:
            labelled(BACKEND_IN_FLIGHT, name).inc()
        return lease

    async def take(self, name: str, limit: int, *, force: bool = False) -> tuple[Lease | None, int]:
        """A lease on ``name`` when fewer than ``limit`` are live (always, with ``force``):
        (the lease, the live count), or (None, the live count) when full. A store that
        fails gives (None, 0): nothing is refused for it."""
        token = self._prefix + str(next(self._ids))
        try:
            taken, live = await self.store.lease_acquire(
                name, token, limit, self.lease, force=force
            )
        except Exception as exc:  # a store must never fail a request
            self._store_failed(exc)
            return None, 0
        if not taken:
            return None, max(1, live)
        self._live.setdefault(name, set()).add(token)
        self._ensure_renewer()
        return Lease(name, token, live), live

    async def leave(self, lease: Lease | None) -> None:
        """Give ``lease`` back (None: nothing to give)."""
        if lease is None:
            return
        tokens = self._live.get(lease.backend)
        if tokens is not None:
            tokens.discard(lease.token)
            if not tokens:
                del self._live[lease.backend]
        if not self._live and self._renewer is not None:
            self._renewer.cancel()  # nothing left to renew; the next lease starts another
            self._renewer = None
        if "\t" not in lease.backend:  # (a caller key's lease is no backend's)
            labelled(BACKEND_IN_FLIGHT, lease.backend).dec()
        try:
            await self.store.lease_release(lease.backend, lease.token)
        except Exception as exc:  # it runs out by itself
            self._store_failed(exc)

    async def in_flight(self, backend: str) -> int:
        """Attempts in flight at ``backend``, across every replica sharing the store."""
        return await self.store.lease_count(backend)

    async def aclose(self) -> None:
        """Stop renewing (leases still held run out by themselves)."""
        task, self._renewer = self._renewer, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    def _ensure_renewer(self) -> None:
        task = self._renewer
        if task is None or task.done():
            self._renewer = asyncio.get_running_loop().create_task(
                self._renew(), name="tierchain-admission-renew"
            )

    async def _renew(self) -> None:
        """While this process holds leases, extend them every third of their life."""
        every = self.lease / 3
        while self._live:
            await asyncio.sleep(every)
            for name, tokens in list(self._live.items()):
                if not tokens:
                    continue
                try:
                    await self.store.lease_renew(name, list(tokens), self.lease)
                except Exception as exc:
                    self._store_failed(exc)
        self._renewer = None

    def _store_failed(self, exc: Exception) -> None:
        now = clock.now()
        if now - self._warned >= _WARN_EVERY:
            self._warned = now
            log_event("admission.store_failed", level=logging.WARNING, error=repr(exc))
