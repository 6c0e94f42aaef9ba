"""Notice a departed caller without waiting for a send to fail.

uvicorn turns ``send`` into a silent no-op once the caller has gone, so a
layer that only sends would stream on forever. After the request body has been
read, :class:`DisconnectGuard` owns the one remaining use of ``receive``: a
watcher task waits for ``http.disconnect`` and cancels the task doing the work.
Inner apps get :meth:`DisconnectGuard.receive` instead, which reports the
disconnect when it happens.

The watcher starts only after ``WATCH_AFTER`` seconds: a request answered
sooner (most refusals, most fast answers) never pays for a task, and a caller
that leaves is still noticed within a fraction of a second. Rather than a loop
timer per request, the guards of one event loop wait in a queue in the order
they started, on the package's scheduler (:mod:`tierchain._runtime.deadlines`:
a FIFO for this one delay), which starts the watchers of those that are still
running ``WATCH_AFTER`` later.

The layers outside Failover (Heartbeats, Budget) have per-request deadlines of their
own, almost always due later than ``WATCH_AFTER``. The outermost of them starts the
request's :class:`Young` phase (``TierRequest.young``): one deadline, ``WATCH_AFTER``
after the request started, that arms each such layer's deadline (at the same time it
would have had) only if the request lives that long; the guard joins it too when it
would fall due then. A request answered sooner arms one deadline, not three.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import Any

from ._runtime import clock, deadlines
from ._runtime.interrupt import Interruption
from ._types import Message, Receive

WATCH_AFTER = 0.02


class Young:
    """A request's first ``WATCH_AFTER`` seconds: one deadline for the timers that only
    a request living that long needs.

    Started (and ended by :meth:`close` with the request) by the outermost layer that
    has the request (Heartbeats, Budget; Failover's guard when there is neither). A
    layer whose deadline falls due later than :attr:`ends` (plus the scheduler's
    ``EARLY``) appends a call to :attr:`then` instead of arming it
    (``TierRequest.after_young``): each is called once at :attr:`ends`, arms its own
    deadline at the very time it would have had, and checks first that its own part of
    the request is not over. ``then`` is None once the phase is over (or closed): a
    layer then arms its deadline itself.
    """

    __slots__ = ("ends", "entry", "then")

    def __init__(self, started: float) -> None:
        self.ends = started + WATCH_AFTER
        self.then: list[Callable[[], object]] | None = []
        # (WATCH_AFTER recurs: the guards' own FIFO holds it.)
        self.entry: deadlines.Deadline | None = deadlines.schedule_at(
            self.ends, self._over, lane=WATCH_AFTER
        )

    def _over(self) -> None:
        self.entry = None
        then, self.then = self.then, None
        if then:
            for call in then:
                call()

    def close(self) -> None:
        """The request is over: nothing waits any more (the calls refer back to the
        request's objects: no cycle is left)."""
        self.then = None
        entry = self.entry
        if entry is not None:
            self.entry = None
            deadlines.cancel(entry)


class DisconnectGuard:
    """Cancel the owning task promptly when the caller disconnects.

    Use as ``async with DisconnectGuard(receive) as guard:``; the context
    swallows the cancellation it caused and lets every other one through.
    Set :attr:`done` once the response is complete so a late disconnect
    (uvicorn reports one when the response ends) cancels nothing.
    """

    __slots__ = (
        "_gone",
        "_queued",
        "_receive",
        "_watcher",
        "cut",
        "done",
        "then",
        "young",
    )

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.cut = Interruption()  # armed by enter
        self._watcher: asyncio.Future[Message] | None = None
        self.done = False
        self._gone: asyncio.Event | None = None  # made when first needed
        self._queued: deadlines.Deadline | None = None  # while waiting for its watcher
        self.young = False
        """True from :meth:`enter` until the request has run ``WATCH_AFTER`` seconds
        (:attr:`then` still due): a field, not a property (Failover reads it per request)."""
        self.then: list[Callable[[], object]] = []
        """Each called once when the request has run ``WATCH_AFTER`` seconds (if still
        guarded): work for a request that lives that long, not paid by one answered
        sooner (Failover's send_timeout watch, the watchdog's decode watch). Added to
        only while :attr:`young`; each checks that its own attempt is not over."""

    @property
    def gone(self) -> asyncio.Event:
        """Set once the caller has disconnected."""
        if self._gone is None:
            self._gone = asyncio.Event()
        return self._gone

    async def __aenter__(self) -> DisconnectGuard:
        self.enter()
        return self

    def enter(self, phase: Young | None = None) -> None:
        """Start guarding the running task (what ``async with`` does on entry).

        ``phase``: the request's :class:`Young` phase, if a layer outside started one:
        joined when its end is this guard's own ``WATCH_AFTER`` (within the scheduler's
        ``EARLY``: no body read took time between), instead of a deadline of its own."""
        self.cut.arm()
        self.young = True
        if phase is not None:
            then = phase.then
            if then is not None and clock.now() + WATCH_AFTER <= phase.ends + deadlines.EARLY:
                then.append(self.due_now)
                return
        self._queued = deadlines.schedule(WATCH_AFTER, self.due_now)

    @property
    def task(self) -> asyncio.Task[Any] | None:
        """The task this guard cancels (the request's), once entered."""
        return self.cut.task

    def due_now(self) -> None:
        """The request has run ``WATCH_AFTER`` seconds: watch it, and call :attr:`then`."""
        if not self.young:
            return  # closed before (a phase it joined outlives it)
        self._queued = None
        self.young = False
        self.start_watching()
        then = self.then
        if then:
            self.then = []
            for call in then:
                call()

    def start_watching(self) -> None:
        """Start the watcher task (once the request has run ``WATCH_AFTER`` seconds).

        The task is the host's own ``receive()``, with a callback for its message:
        no coroutine of ours waits alongside it.
        """
        if self._watcher is None and not self.done:
            watcher = self._watcher = asyncio.ensure_future(self._receive())
            watcher.set_name("tierchain-disconnect-watch")
            watcher.add_done_callback(self._received)

    def _received(self, watcher: asyncio.Future[Message]) -> None:
        self._watcher = None
        if watcher.cancelled():
            return  # the guard closed
        if watcher.exception() is not None:
            return  # the host's receive failed: nothing more to watch (and nothing to cancel)
        if watcher.result()["type"] != "http.disconnect":
            self.start_watching()  # something else (a late body chunk): keep listening
            return
        self.gone.set()
        if not self.done:
            self.cut.interrupt("tierchain: the caller disconnected")

    async def receive(self) -> Message:
        """What an inner app gets after the body: waits for the disconnect."""
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self.close()
        return exc_type is asyncio.CancelledError and self.caused_cancellation()

    def close(self) -> None:
        """Stop guarding: the response is over (what ``async with`` does on exit)."""
        self.done = True
        if self.young:
            self.young = False
            queued = self._queued
            if queued is not None:
                self._queued = None
                deadlines.cancel(queued)
            if self.then:
                self.then = []  # (they refer to attempts that refer to us: no cycle left)
        if self._watcher is not None:
            self._watcher.cancel()

    def caused_cancellation(self) -> bool:
        """For a cancellation that ended the block: True when it was this guard's own.

        Only then is it swallowed (and undone), and only when no other cancellation
        (a Budget timeout, a server shutdown) is pending.
        """
        return self.cut.ours()


class Replay:
    """An attempt's ``receive`` (Failover's, or a hedge's): the buffered body once, then
    the caller's disconnect through the guard."""

    __slots__ = ("body", "guard")

    def __init__(self, body: bytes, guard: DisconnectGuard) -> None:
        self.body: bytes | None = body
        self.guard = guard

    async def __call__(self) -> Message:
        body = self.body
        if body is not None:
            self.body = None
            return {"type": "http.request", "body": body, "more_body": False}
        return await self.guard.receive()
