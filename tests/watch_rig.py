"""The rig of the rule-by-rule watch tests (tests/test_watch_windows.py,
test_watch_verdicts.py, test_watch_status.py): one attempt's :class:`~tierchain.watch.Watch`
with a real SaturationWatchdog as its keeper and Failover's own request and attempt types,
begun in a task of its own (a watch cuts the task it was begun in) and timed on the
virtual clock.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from tierchain import Backend, SaturationWatchdog
from tierchain.observer import Observer
from tierchain.request import Attempt, TierRequest
from tierchain.watch import Watch

from .support import now

TOWER = Backend("tower", "http://127.0.0.1:9")
HOSTED = Backend("hosted", "https://api.example.com")

FIRST = b'data: {"a": 1}\n\n'
MORE = b'data: {"a": 2}\n\n'


async def _nothing(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("not called")


def keeper(ceiling: float = 600.0, **options: Any) -> SaturationWatchdog:
    """The watchdog a watch reads its options from (no learned windows, no prompt or
    decode rate unless asked)."""
    options.setdefault("prompt_rate", 0)
    options.setdefault("decode_rate", 0)
    return SaturationWatchdog(_nothing, slow_after=10.0, ceiling=ceiling, **options)


def watch_of(
    *,
    last: bool = False,
    deadline: float | None = None,
    ceiling: float = 600.0,
    lines: list[dict[str, Any]] | None = None,
    tier: Backend | None = None,
    watchdog: SaturationWatchdog | None = None,
    continuable: bool = False,
    **options: Any,
) -> Watch:
    """The watch of attempt 1 of 2 (``last``: attempt 2 of 2) of a chain's request, its
    window 10 s and no stall window unless given; ``lines``: its state events;
    ``tier``: the attempt's backend (the chain's first or, ``last``, second);
    ``continuable``: its request's answer may be finished by the next tier."""
    req = TierRequest()
    req.route = "echo"
    req.continuable = continuable
    chain = (tier or TOWER, HOSTED) if not last else (TOWER, tier or HOSTED)
    req.chain = chain
    req.in_chain = True
    req.deadline = deadline
    req.listen(lambda event: (lines if lines is not None else []).append(dict(event)))
    req.observer = Observer()
    n = 2 if last else 1
    attempt = Attempt(n, 2, chain[n - 1], "echo", deadline=deadline)
    req.attempt = attempt
    options.setdefault("window", 10.0)
    options.setdefault("stall", 0.0)
    return Watch(watchdog or keeper(ceiling), req, attempt, last=last, **options)


Steps = Callable[[Watch], Awaitable[None]]


async def run(
    watch: Watch, steps: Steps | None = None, *, within: float = 3600.0
) -> tuple[str | None, float]:
    """Begin the watch in a task of its own, play ``steps`` (what the attempt gets, when),
    then wait ``within``: (why the watch fired, seconds after the start; None and the
    whole time when it never fired). A timer callback that raised into the loop fails."""
    loop = asyncio.get_running_loop()
    raised: list[dict[str, Any]] = []
    handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: raised.append(context))
    t0 = now()

    async def attempt() -> None:
        watch.begin()
        if steps is not None:
            await steps(watch)
        await asyncio.sleep(within)

    task = asyncio.create_task(attempt())
    try:
        await task
    except asyncio.CancelledError:
        pass
    took = now() - t0
    ended = watch.end()
    if inspect.isawaitable(ended):
        await ended
    loop.set_exception_handler(handler)
    assert not raised, raised
    return watch.fired, took


async def cut_at(watch: Watch, *, within: float = 3600.0) -> tuple[str | None, float]:
    """An attempt that never answers: (why the watch fired, when)."""
    return await run(watch, within=within)


def commit(watch: Watch, data: bytes = FIRST) -> None:
    """The attempt's stream begins: its head, a first data event sent on to the caller."""
    req, observer = watch.req, watch.observer
    assert req is not None
    observer.start(200, [(b"content-type", b"text/event-stream")])
    observer.body(data)
    req.committed = True
    watch.first_data()


def lane(watch: Watch) -> float | str | None:
    """Where the watch's timer waits: the FIFO lane of its delay (a delay that recurs), or
    the heap (a one-off)."""
    from tierchain._runtime import deadlines

    timers = deadlines._TIMERS.get()
    if watch._handle is None:
        return None
    seq = watch._handle.seq
    if any(s == seq for _, s in timers.heap):
        return "heap"
    return next((d for d, fifo in timers.fifos.items() if seq in fifo.seqs), None)
