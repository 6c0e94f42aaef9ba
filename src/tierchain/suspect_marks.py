"""Suspect marks: one verdict spares the next callers.

When the watchdog judges a backend (too slow, stalled, starved, broke mid-stream, lost
its hedge), the callers after skip it as busy for ``suspect_for`` seconds instead of
each waiting out a window of their own; then one caller's attempt probes it, and its
verdict (marked again) or its health (the mark dropped) decides for the others. The
marks live in the store (:meth:`tierchain.store.MemoryStore.suspect_check` and its
Redis twin: replicas share them); a store that fails never fails a request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from .errors import BackendBusy
from .request import Attempt
from .store import MemoryStore, NormalStore, Suspect
from .telemetry import SUSPECT_MARKS, labelled, log_event

__all__ = ["SuspectMarks"]

_BACKGROUND: set[asyncio.Task[None]] = set()  # store writes in flight (kept from the collector)
_LEASE = 120.0  # the most one probe of a suspect backend holds its slot


class SuspectMarks:
    """The watchdog's suspect marks in ``store``, each held ``suspect_for`` seconds (0: off)."""

    __slots__ = ("_memory", "local", "store", "suspect_for")

    def __init__(self, store: NormalStore, suspect_for: float) -> None:
        self.store = store
        self.suspect_for = suspect_for
        # This process's own store (not a subclass): asked without a coroutine.
        self._memory = store if type(store) is MemoryStore else None
        self.local = self._memory is not None  # (then ask check_now)

    def check_now(self, attempt: Attempt) -> Suspect | None:
        """:meth:`check` without a coroutine, for marks kept in this process (``local``)."""
        assert self._memory is not None
        name = attempt.backend.name
        try:
            mark = self._memory.suspect_check_now(name, _LEASE)
        except Exception as exc:  # a store must never fail a request: not suspect
            _store_failed(exc)
            return None
        return None if mark is None else _passes(name, mark)

    async def check(self, attempt: Attempt) -> Suspect | None:
        """Skip a backend an earlier caller's attempt was judged on (``BackendBusy``), or
        return the mark this attempt passes as its one probe (None: not suspect)."""
        name = attempt.backend.name
        try:
            mark = await self.store.suspect_check(name, _LEASE)
        except Exception as exc:  # a store must never fail a request: not suspect
            _store_failed(exc)
            return None
        return _passes(name, mark)

    def mark(self, route: str, backend: str, why: str) -> None:
        """A verdict on ``backend`` (too slow, stalled, broke mid-stream): the callers after
        skip it for ``suspect_for`` seconds, then one probes it. Written to the store now,
        in the background for a remote one."""
        if self.suspect_for <= 0:
            return
        labelled(SUSPECT_MARKS, route, backend, why).inc()
        log_event("watchdog.backend_suspect", route=route, backend=backend, why=why)
        memory = self._memory
        if memory is not None:
            memory.suspect_mark_now(backend, why, self.suspect_for)
            return
        self._background(self.store.suspect_mark(backend, why, self.suspect_for))

    def passed(self, backend: str, *, marked: bool, healthy: bool) -> None:
        """The probe of a suspect ``backend`` ended: ``marked`` again by its verdict (the
        mark is set anew, its probe slot with it), ``healthy`` (the mark dropped), or
        neither (its probe slot given back)."""
        if marked:
            return
        memory = self._memory
        if memory is not None:
            memory.suspect_end_now(backend, healthy=healthy)
            return
        self._background(self.store.suspect_end(backend, healthy=healthy))

    def _background(self, call: Awaitable[Any]) -> None:
        """A store call nobody waits for (RedisStore finishes it even if the request ends)."""

        async def run() -> None:
            try:
                await call
            except Exception as exc:
                _store_failed(exc)

        task = asyncio.ensure_future(run())
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)


def _passes(name: str, mark: Suspect | None) -> Suspect | None:
    """``mark`` when this attempt is its probe (None: not suspect); else BackendBusy."""
    if mark is None or mark.probe:
        if mark is not None:
            log_event("watchdog.suspect_probe", backend=name, why=mark.why)
        return mark
    why = f"suspect: {mark.why} on an earlier request, tried again in {mark.retry_in:.0f}s"
    raise BackendBusy(f"backend {name!r} is {why}", why=why)


def _store_failed(exc: Exception) -> None:
    log_event("watchdog.suspect_store_failed", level=logging.WARNING, error=repr(exc))
