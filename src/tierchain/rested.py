"""RestChecks: the gateway finds a rested backend itself, not a caller.

A breaker opened for saturation stays open ``saturation_cooldown`` (15 minutes): right for a
GPU a game holds for hours, wrong for one freed a minute later. While it is open no caller is
sent there, so without a check of its own the gateway would learn that the backend rested only
when the cooldown ran out. The Breaker therefore re-checks every such backend itself, every
``rest_check_every`` seconds (5 s) while its breaker stays open for saturation:

- a backend with a status URL and a :class:`~tierchain.status.StatusBoard` (the watchdog's):
  its polled status, read every second (which keeps the poller polling);
- a **local** backend without one (:func:`~tierchain.backend.is_local`): one small request of
  the gateway's own, a one-token completion in the backend's wire format
  (:func:`check_request`), whose first data must come within ``rest_check_timeout`` (2 s).
  A backend that is not local (a paid API) is never sent a request of ours.

A rested backend (an idle status, or a check answered in time) **half-opens** its breaker:
the next request is its probe, as after a cooldown, and closes it on success; a probe that
saturates re-opens it (for the growing re-open cooldown) and the checks start again. So no
caller pays for a check, and one caller at most pays for a wrong one (a one-token answer is
weak evidence: a tower starved but still quick on a tiny prompt looks rested).

Single flight across replicas: each check takes a lease in the store (a
:class:`~tierchain.store.LeaseStore`, limit 1, key ``rest-check:<route>:<backend>``) for
most of ``rest_check_every`` and lets it run out, so replicas sharing a RedisStore send one
check between them every ``rest_check_every``, not one each.

Tasks have owners: one task per (route, backend) (``tierchain-rest-check``), owned by this
object. It ends by itself when the breaker is no longer open for saturation, or at the
latest after ``saturation_cooldown`` (the longest the breaker could stay open without it);
:meth:`RestChecks.aclose` cancels and awaits them (the Breaker's lifespan shutdown).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable

import httpx

from . import formats
from ._connections import trust_store
from ._runtime import clock
from ._target import Target, upstream_url
from .backend import Backend, is_local
from .errors import TierchainError
from .observer import Observer
from .probes import auto_reader
from .status import StatusBoard, idle
from .store import BreakerPolicy, LeaseStore, Store, Ticket
from .telemetry import BREAKER_REST_CHECKS, labelled, log_event

__all__ = ["TASK_NAME", "RestChecks", "check_request", "rested"]

TASK_NAME = "tierchain-rest-check"
"""The name of a re-check task (one per (route, backend) whose breaker is open for saturation)."""

_STATUS_EVERY = 1.0  # a status is read at least this often (the board stops an unasked poller)
_PROMPT = "Hi"

Observe = Callable[[str, str, Ticket], None]
"""How the Breaker hears of a transition a check caused (its gauge and log lines)."""


def check_request(
    backend: Backend, route: str, wire: str | None
) -> tuple[str, bytes, dict[str, str]]:
    """The gateway's own small request to ``backend``: a one-token completion in its wire
    format (``backend.wire_format``, else the route's ``wire``, else OpenAI chat), for the
    model ``backend.model`` or the route's name. Returns (URL, body, headers)."""
    fmt = formats.of(backend.wire_format or wire)
    path, body, own = fmt.check_request(backend.model or route or "default", _PROMPT)
    headers = {
        "content-type": "application/json",
        "accept": "text/event-stream",
        "accept-encoding": "identity",
        **own,
    }
    for name, value in backend.headers.items():
        headers[name.lower()] = value
    url = upstream_url(backend.url, Target(path, b""))
    return url, json.dumps(body, separators=(",", ":")).encode(), headers


async def rested(
    client: httpx.AsyncClient, backend: Backend, route: str, wire: str | None, limit: float
) -> str:
    """One check of ``backend`` (:func:`check_request`): ``rested`` (its first data within
    ``limit`` seconds), ``busy`` (not within it, or a 429/503), ``unknown`` (no answer to
    judge: refused, an error status, a broken stream)."""
    url, body, headers = check_request(backend, route, wire)
    observer = Observer(stream_end=backend.stream_end, wire=backend.wire_format or wire)
    try:
        async with (
            asyncio.timeout(limit),
            client.stream("POST", url, content=body, headers=headers) as response,
        ):
            status = response.status_code
            if status in (429, 503, 529):
                return "busy"
            if status >= 300:
                return "unknown"
            observer.start(status, [(k.lower(), v) for k, v in response.headers.raw])
            async for chunk in response.aiter_raw():
                observer.body(chunk)
                if observer.first_data_at is not None:
                    return "rested"
            observer.end()
            return "rested" if observer.first_data_at is not None else "unknown"
    except TimeoutError:
        return "busy"
    except (httpx.HTTPError, OSError, TierchainError, ValueError):
        return "unknown"


class RestChecks:
    """The re-checks of backends opened for saturation (see the module docstring).

    ``every`` is the time between two checks (0: none), ``timeout`` a check's limit on
    its first data; ``board`` the status board whose statuses are read, when a backend
    has a status URL; ``observe`` tells the Breaker of a transition a wake caused.
    """

    def __init__(
        self,
        store: Store,
        policy: BreakerPolicy,
        *,
        every: float,
        timeout: float,
        board: StatusBoard | None,
        observe: Observe,
    ) -> None:
        self.store = store
        self.policy = policy
        self.every = every
        self.timeout = timeout
        self.board = board
        self.observe = observe
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}

    def watch(self, route: str, backend: Backend, wire: str | None) -> None:
        """The breaker of (``route``, ``backend``) is open for saturation: check it in the
        background, unless a check already runs (or it cannot be checked)."""
        if self.every <= 0:
            return
        by_status = backend.status_url is not None and self.board is not None
        if not by_status and not is_local(backend):
            return  # a paid API is never sent a request of ours
        key = (route, backend.name)
        loop = asyncio.get_running_loop()
        task = self._tasks.get(key)
        if task is not None and not task.done() and task.get_loop() is loop:
            return
        task = loop.create_task(self._run(route, backend, wire), name=TASK_NAME)
        self._tasks[key] = task
        task.add_done_callback(lambda t: self._forget(key, t))

    def _forget(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self._tasks.get(key) is task:
            del self._tasks[key]
        if not task.cancelled() and task.exception() is not None:  # (logged, never raised)
            log_event("breaker.rest_check_failed", level=30, error=repr(task.exception()))

    def checking(self) -> list[tuple[str, str]]:
        """The (route, backend) pairs being checked now."""
        return [key for key, task in self._tasks.items() if not task.done()]

    async def _run(self, route: str, backend: Backend, wire: str | None) -> None:
        """Check every ``every`` seconds while the breaker stays open for saturation."""
        name = backend.name
        until = clock.now() + self.policy.saturation_cooldown + self.every
        by_status = backend.status_url is not None and self.board is not None
        step = min(self.every, _STATUS_EVERY) if by_status else self.every
        client: httpx.AsyncClient | None = None
        next_at = clock.now() + step
        try:
            while clock.now() < until:
                # Every ``step`` from the last round's start (a check's own wait included).
                await asyncio.sleep(max(0.0, next_at - clock.now()))
                next_at = clock.now() + step
                try:
                    snap = await self.store.breaker_snapshot(route, name)
                except Exception:
                    continue  # a store that fails: look again next round
                if snap.state != "open" or snap.reason != "saturation":
                    return  # closed, or half-open (a probe decides), or open for another reason
                result: str | None
                if by_status:
                    result = self._status(backend)
                else:
                    if client is None:
                        client = httpx.AsyncClient(
                            timeout=None,
                            follow_redirects=False,
                            trust_env=False,
                            verify=trust_store(),
                        )
                    result = await self._check(client, route, backend, wire)
                if result is None:
                    continue  # another replica checks this round
                labelled(BREAKER_REST_CHECKS, route, name, result).inc()
                if result == "rested" and await self._wake(route, name):
                    log_event(
                        "breaker.rested",
                        logging.INFO,
                        route=route,
                        backend=name,
                        by="status" if by_status else "check",
                    )
                    return
        finally:
            if client is not None:
                await client.aclose()

    def _status(self, backend: Backend) -> str:
        board, url = self.board, backend.status_url
        if board is None or url is None:
            return "unknown"
        status = board.peek(url, auto_reader)
        if status is None:
            return "unknown"
        return "rested" if idle(status) else "busy"

    async def _check(
        self, client: httpx.AsyncClient, route: str, backend: Backend, wire: str | None
    ) -> str | None:
        """One request check, one per round across replicas (None: another has the lease)."""
        store = self.store
        leases = store if isinstance(store, LeaseStore) else None
        key = f"rest-check:{route}:{backend.name}"
        token = uuid.uuid4().hex
        if leases is not None:
            # Held for most of a round and left to run out: one check per round between
            # every replica sharing the store (this one's next round finds it gone).
            try:
                taken, _ = await leases.lease_acquire(key, token, 1, self.every * 0.9)
            except Exception:
                taken = True  # a store that fails: this process checks on its own
            if not taken:
                return None
        return await rested(client, backend, route, wire, self.timeout)

    async def _wake(self, route: str, name: str) -> bool:
        """Half-open the breaker (the next request is its probe): True when it did."""
        try:
            ticket = await self.store.breaker_acquire(route, name, self.policy, wake=True)
        except Exception:
            return False
        self.observe(route, name, ticket)
        if ticket.probe:  # the slot the wake gave us goes to the next request
            try:
                await self.store.breaker_record(
                    route, name, self.policy, "neutral", gen=ticket.gen, probe=ticket.probe
                )
            except Exception:
                pass  # the slot's lease runs out (probe_lease)
        return ticket.state == "half_open"

    async def aclose(self) -> None:
        """Cancel every check of the running event loop and wait for them to end."""
        loop = asyncio.get_running_loop()
        tasks = [t for t in self._tasks.values() if t.get_loop() is loop and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
