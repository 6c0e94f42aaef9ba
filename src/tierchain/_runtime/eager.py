"""Start a coroutine eagerly: run it here up to its first wait, and give it a task only if
it waits.

This stands in for ``asyncio.Task(coro, eager_start=True)`` (Python 3.12; the argument of
``asyncio.create_task`` from 3.14), which is what :func:`start_eagerly` calls where the
interpreter has it. Python 3.11 has no eager start, so there the first step is taken by
hand (``coro.send``) and the rest continues in a task through ``_Resume``, a trampoline
that hands each later step and any cancellation to the coroutine.

Heartbeats uses it for the keepalive a timer wakes: a keepalive to a caller that keeps up
is written without a task and without an extra turn of the loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import Coroutine, Generator
from typing import Any

__all__ = ["start_eagerly"]

_EAGER = sys.version_info >= (3, 12)


def start_eagerly(
    coro: Coroutine[Any, Any, None], *, name: str, context: contextvars.Context
) -> asyncio.Task[Any] | None:
    """Run ``coro`` in ``context`` up to its first wait; the task that carries on with it,
    or None when it finished without waiting."""
    loop = asyncio.get_running_loop()
    if _EAGER:
        task = asyncio.Task(  # type: ignore[call-arg,unused-ignore]
            coro, loop=loop, name=name, context=context, eager_start=True
        )
        return None if task.done() else task
    try:
        waiting_on = context.run(coro.send, None)
    except StopIteration:
        return None
    return loop.create_task(_carry_on(_Resume(coro, waiting_on)), name=name, context=context)


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
