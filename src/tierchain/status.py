"""Status polling in the background: know a backend is full before sending to it.

A :class:`StatusBoard` keeps one poller per status URL in this process, and
at most one GET of a status URL is in flight at a time: the poller's turn, an
attempt that asks before it is sent and a stalled attempt's probe all wait on
the same GET (:func:`tierchain.probes.fetch_status_once`). A
poller starts on demand, the first time someone asks about its URL
(:meth:`StatusBoard.peek`), GETs the URL every ``interval`` seconds while
traffic keeps asking, and stops by itself once nobody asked for ``idle_stop``
seconds: no polling while idle. Each poller is a task the board owns, with an
HTTP client of its own that it closes when it stops; :meth:`StatusBoard.aclose`
cancels them all.

:meth:`StatusBoard.peek` never waits: it answers the latest status if it is
fresher than ``stale_after`` seconds, otherwise None (unknown). When an attempt
at the backend ends, what was read before is dropped
(:meth:`StatusBoard.outdated`): the slot it showed busy may have been ours. A status that
is stale, slow or failing never blocks a backend: unknown means try it.

:func:`full` applies the thresholds (the same defaults as the Gateway API
Inference Extension: 5 waiting requests, 80% KV cache), plus "every slot busy"
for llama.cpp's ``/slots``.

One board serves one gateway: the SaturationWatchdog creates it (with its
options), and the layers that wrap that watchdog read the same board
(:func:`board_within`, at construction): the Breaker to half-open a breaker
opened for saturation as soon as the backend reports idle, the Failover's
picker to score a pool's replicas. Two gateways in one process each have
their own; ``status_board=`` on those layers (and on the watchdog) wires one by hand,
as :func:`~tierchain.stack.build_stack` and the README do; :func:`board_within` is the
fallback for a layer given none.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass
from datetime import timedelta

import httpx

from ._checks import duration
from ._connections import trust_store
from ._runtime import clock
from .probes import (
    Reader,
    Status,
    end_flights,
    fetch_status,
    fetch_status_once,
    status_asked_at,
    status_sent_at,
    total_slots,
)

__all__ = ["Fullness", "StatusBoard", "board_within", "full", "idle"]


@dataclass(frozen=True, slots=True)
class Fullness:
    """The thresholds past which a backend's status says it is full."""

    waiting: int = 5
    """Requests waiting (vLLM ``num_requests_waiting``, llama.cpp ``requests_deferred``)."""
    kv_cache: float = 0.8
    """KV-cache use, 0..1."""
    all_slots: bool = True
    """Every ``/slots`` slot busy counts as full."""


def full(status: Status | None, limits: Fullness) -> str | None:
    """Why ``status`` says the backend is full (``"5 waiting"``, ...), or None."""
    if status is None:
        return None
    if status.waiting is not None and status.waiting >= limits.waiting:
        return f"{status.waiting} waiting"
    if status.kv_cache is not None and status.kv_cache >= limits.kv_cache:
        return f"kv_cache {status.kv_cache:.2f}"
    if (
        limits.all_slots
        and status.slots is not None
        and status.slots > 0
        and status.slots_busy == status.slots
    ):
        return "all slots busy"
    return None


def idle(status: Status | None) -> bool:
    """True when ``status`` is known and says the backend is doing nothing.

    Only idle wakes a breaker opened for saturation: "busy, nothing queued"
    can still be one slot taken by another caller, and waking on it would
    send a probe into the same wait again and again.
    """
    return status is not None and not status.busy


class _Poller:
    __slots__ = (
        "asked",
        "at",
        "cut_until",
        "latest",
        "loop",
        "not_before",
        "reader",
        "slots",
        "task",
    )

    def __init__(self, reader: Reader, loop: asyncio.AbstractEventLoop) -> None:
        self.reader = reader
        self.loop = loop
        self.latest: Status | None = None
        self.at = -math.inf
        self.not_before = -math.inf
        self.cut_until = -math.inf
        self.asked = clock.now()
        self.task: asyncio.Task[None] | None = None
        self.slots: int | None = None  # learned from llama.cpp's /props, for /metrics
        """The server's slot count, once read from its ``/props`` (0: not there)."""


def _props_url(url: str) -> str | None:
    """llama.cpp's ``/props`` next to its ``/metrics``, or None for another URL."""
    base, sep, tail = url.rpartition("/metrics")
    if not sep or tail not in ("", "/"):
        return None
    return base + "/props"


def _with_slots(status: Status | None, slots: int | None) -> Status | None:
    """A ``/metrics`` status with the slot count it does not carry (from ``/props``)."""
    if status is None or not slots or status.slots is not None or status.processing is None:
        return status
    return dataclasses.replace(status, slots=slots, slots_busy=min(status.processing, slots))


class StatusBoard:
    """One background poller per status URL, started on demand, stopped when idle.

    ``interval`` is the time between two GETs of one URL, ``stale_after`` how
    old a status may be and still be used, ``timeout`` bounds each GET, and
    ``idle_stop`` is how long a poller runs on with nobody asking. ``limits``
    are the :class:`Fullness` thresholds.
    """

    def __init__(
        self,
        *,
        interval: float | timedelta = 0.05,
        stale_after: float | timedelta = 0.2,
        timeout: float | timedelta = 1.0,
        idle_stop: float | timedelta = 2.0,
        limits: Fullness | None = None,
    ) -> None:
        self.interval = duration("interval", interval)
        self.stale_after = duration("stale_after", stale_after)
        self.timeout = duration("timeout", timeout)
        self.idle_stop = duration("idle_stop", idle_stop)
        self.limits = limits if limits is not None else Fullness()
        self._pollers: dict[str, _Poller] = {}

    def peek(self, url: str, reader: Reader) -> Status | None:
        """The latest status of ``url`` if fresh, else None; keeps (or starts) its poller."""
        now = clock.now()
        poller = self._pollers.get(url)
        loop = asyncio.get_running_loop()
        if poller is None or poller.loop is not loop:
            poller = self._pollers[url] = _Poller(reader, loop)
        poller.asked = now
        if poller.task is None or poller.task.done():
            poller.task = loop.create_task(self._poll(url, poller), name="tierchain-status-poll")
        if now - poller.at > self.stale_after:
            return None
        return poller.latest

    async def ask(
        self, url: str, reader: Reader, client: httpx.AsyncClient, limit: float
    ) -> Status | None:
        """Read ``url`` now, within ``limit`` seconds (a status that was stale or never
        read, before an attempt is sent); the answer is kept as the latest.

        A GET in flight is joined; but within ``interval`` of the latest GET sent (by the
        poller or another ask), none is sent: the answer is None, unknown, so the attempt
        goes ahead and the poller's next reading tells. A burst of requests never sends
        more GETs than the poller's own pace."""
        poller = self._pollers.get(url)
        started = clock.now()
        if self._too_soon(url, started, poller):
            # That GET's reading (kept as the latest when it landed) answers; None
            # (unknown) while it is not there.
            return poller.latest if poller is not None else None
        status = await fetch_status_once(client, url, limit=limit, reader=reader)
        if poller is None or started < poller.not_before:
            return status if poller is None else None
        if status is not None and poller.slots is None:
            props = _props_url(url)
            if props is not None and status.slots is None and status.processing is not None:
                await self._learn_slots(client, props, poller, limit)
        status = _with_slots(status, poller.slots)
        if status is not None and poller.at < started:
            poller.latest, poller.at = status, clock.now()
        return status

    async def _learn_slots(
        self, client: httpx.AsyncClient, props: str, poller: _Poller, limit: float
    ) -> None:
        count: list[int | None] = []

        def read(body: bytes) -> Status | None:
            count.append(total_slots(body))
            return None

        await fetch_status(client, props, limit=limit, reader=read)
        poller.slots = (count[0] if count else None) or 0

    def _too_soon(self, url: str, now: float, poller: _Poller | None) -> bool:
        """Was a GET of ``url`` sent less than ``interval`` ago, and has it landed? Never
        while a request we cut there may still be running (:meth:`cut`): then the
        backend's own word decides between busy and saturated, and is asked."""
        sent = status_sent_at(url)
        return (
            sent is not None
            and now - sent < self.interval
            and status_asked_at(url) is None
            and (poller is None or now >= poller.cut_until)
        )

    def cut(self, url: str, span: float) -> None:
        """We cut an attempt there before its first chunk: for up to ``span`` seconds
        the server may still be finishing that prompt's batch (busy, not broken)."""
        poller = self._pollers.get(url)
        if poller is not None:
            poller.cut_until = clock.now() + span

    def finishing_cut(self, url: str) -> bool:
        """True while a busy reading may be the server finishing a request we cut."""
        poller = self._pollers.get(url)
        return poller is not None and clock.now() < poller.cut_until

    def outdated(self, url: str) -> None:
        """An attempt at this backend just ended: what was read before no longer holds.

        Without this, a one-slot server still busy with our own previous
        request in the last poll would turn the next request away as busy.
        """
        poller = self._pollers.get(url)
        if poller is not None:
            poller.latest = None
            poller.at = -math.inf
            poller.not_before = clock.now()

    def polling(self) -> list[str]:
        """The status URLs being polled now."""
        return [u for u, p in self._pollers.items() if p.task is not None and not p.task.done()]

    async def _poll(self, url: str, poller: _Poller) -> None:
        async with httpx.AsyncClient(
            timeout=None, follow_redirects=False, trust_env=False, verify=trust_store()
        ) as client:
            try:
                while clock.now() - poller.asked < self.idle_stop:
                    started = clock.now()
                    sent = status_sent_at(url)
                    if self._too_soon(url, started, poller) and sent is not None:
                        # An ask read it since our last turn: our turn starts from that GET.
                        await asyncio.sleep(self.interval - (started - sent))
                        continue
                    status = await fetch_status_once(
                        client, url, limit=self.timeout, reader=poller.reader
                    )
                    if status is not None and poller.slots is None:
                        props = _props_url(url)
                        if props is not None and status.slots is None and status.processing:
                            await self._learn_slots(client, props, poller, self.timeout)
                    status = _with_slots(status, poller.slots)
                    if started < poller.not_before:
                        status = None  # asked before an attempt there ended: outdated
                    poller.latest = status
                    poller.at = clock.now() if status is not None else -math.inf
                    await asyncio.sleep(max(0.0, self.interval - (clock.now() - started)))
            finally:
                await end_flights(client)  # no GET of ours outlives the client

    async def aclose(self) -> None:
        """Cancel every poller of the running event loop and wait for them to end."""
        loop = asyncio.get_running_loop()
        tasks = [
            p.task
            for p in self._pollers.values()
            if p.task is not None and p.loop is loop and not p.task.done()
        ]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._pollers = {u: p for u, p in self._pollers.items() if p.loop is not loop}


def board_within(app: object) -> StatusBoard | None:
    """The status board of the nearest layer inside ``app`` that has one (a
    SaturationWatchdog polling statuses, or a layer given one as
    ``status_board``), following each layer's ``app``; None when there is none.
    Read once, when a layer is built: never per request."""
    seen: set[int] = set()
    node: object | None = app
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        for name in ("status_board", "board"):
            board = getattr(node, name, None)
            if isinstance(board, StatusBoard):
                return board
        node = getattr(node, "app", None)
    return None
