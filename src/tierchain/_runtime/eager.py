"""Start a coroutine eagerly: run it here up to its first wait, and give it a task only if
it waits.

This stands in for ``asyncio.Task(coro, eager_start=True)`` (Python 3.12; the argument of
``asyncio.create_task`` from 3.14), which is what :func:`start_eagerly` calls where the
interpreter has it. Python 3.11 has no eager start, so there the first step is taken by
hand (``coro.send``) and the rest continues in a task through ``_Resume``, a trampoline
that hands each later step and any cancellation to the coroutine.

:func:`run_until_wait` takes the same first step inside the running task, for a wait
that is most often not one (a request body the server already holds).

Heartbeats uses it for the keepalive a timer wakes: a keepalive to a caller that keeps up
is written without a task and without an extra turn of the loop. It also asks, with
:func:`finished`, whether a server's send coroutine it passed on as is has come back: the
one question the package asks of a coroutine it did not start.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import Callable, Coroutine, Generator
from typing import Any

__all__ = ["finished", "run_until_wait", "start_eagerly"]

_EAGER = sys.version_info >= (3, 12)

_Start = Callable[
    [Coroutine[Any, Any, None], asyncio.AbstractEventLoop, str, contextvars.Context],
    "asyncio.Task[Any] | None",
]


def start_eagerly(
    coro: Coroutine[Any, Any, None], *, name: str, context: contextvars.Context
) -> asyncio.Task[Any] | None:
    """Run ``coro`` in ``context`` up to its first wait; the task that carries on with it,
    or None when it finished without waiting."""
    return _START(coro, asyncio.get_running_loop(), name, context)


def eager_task(
    coro: Coroutine[Any, Any, None],
    loop: asyncio.AbstractEventLoop,
    name: str,
    context: contextvars.Context,
    *,
    task: Callable[..., asyncio.Task[Any]] = asyncio.Task,
) -> asyncio.Task[Any] | None:
    """The 3.12 way: ``asyncio.Task(eager_start=True)``, None when it finished at once.
    (``task`` is the Task class; a test on 3.11 gives one that starts eagerly.)"""
    started = task(coro, loop=loop, name=name, context=context, eager_start=True)
    return None if started.done() else started


def by_hand(
    coro: Coroutine[Any, Any, None],
    loop: asyncio.AbstractEventLoop,
    name: str,
    context: contextvars.Context,
) -> asyncio.Task[Any] | None:
    """The 3.11 way: the first step taken here, the rest in a task through ``_Resume``."""
    try:
        waiting_on = context.run(coro.send, None)
    except StopIteration:
        return None
    return loop.create_task(_carry_on(_Resume(coro, waiting_on)), name=name, context=context)


_START: _Start = eager_task if _EAGER else by_hand


def run_until_wait(coro: Coroutine[Any, Any, Any]) -> tuple[bool, Any]:
    """Run ``coro`` here, in the running task, up to its first wait: ``(True, its
    result)`` when it finished without waiting, else ``(False, the rest)``, an awaitable
    to await in the same task (what it waits for goes up to the task, a cancellation
    down to it)."""
    try:
        waiting_on = coro.send(None)
    except StopIteration as stop:
        return True, stop.value
    return False, _Resume(coro, waiting_on)


def finished(coro: Coroutine[Any, Any, Any]) -> bool:
    """Has ``coro`` finished (returned, raised or been closed)? ``inspect.getcoroutinestate``'s
    ``CORO_CLOSED``, for the cost of one attribute read: a coroutine has no frame only then."""
    return coro.cr_frame is None  # type: ignore[attr-defined]


class _Resume:
    """Await a coroutine already run up to ``waiting_on`` (what it waits for)."""

    __slots__ = ("coro", "waiting_on")

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting_on: Any) -> None:
        self.coro = coro
        self.waiting_on = waiting_on

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value = self.coro, self.waiting_on
        self.waiting_on = None
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # cancellation: it goes to the coroutine
                try:
                    value = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


async def _carry_on(rest: _Resume) -> Any:
    """The rest of a coroutine that began outside any task and has to wait."""
    return await rest
