"""The eager start (`_runtime/eager.py`): both its branches, whatever Python runs the tests.

Python 3.12 has ``asyncio.Task(eager_start=True)``; 3.11 has not, and there the first step is
taken by hand. Each branch is a function of its own, so the one the running interpreter does
not pick is tested too: the 3.12 branch with the Task class it is given (on 3.11, a stand-in
that starts eagerly the way 3.12's does: the first step at once, a task only for the rest).
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from typing import Any

import pytest

from tierchain._runtime import eager

WHO: contextvars.ContextVar[str] = contextvars.ContextVar("WHO", default="nobody")


class _EagerTask:
    """What 3.12's ``asyncio.Task(..., eager_start=True)`` does, for a 3.11 interpreter."""

    made: list[dict[str, Any]] = []

    def __new__(cls, coro: Any, **options: Any) -> Any:
        cls.made.append(dict(options))
        if sys.version_info >= (3, 12):
            return asyncio.Task(coro, **options)
        options.pop("eager_start")
        task = eager.by_hand(coro, options["loop"], options["name"], options["context"])
        if task is None:  # it finished at once: a done task, as 3.12 returns
            done = options["loop"].create_future()
            done.set_result(None)
            return done
        return task


def _steps(log: list[str], *, waits: bool) -> Any:
    async def coro() -> None:
        log.append(f"first step as {WHO.get()}")
        if waits:
            await asyncio.sleep(0)
            log.append(f"second step as {WHO.get()}")

    return coro()


@pytest.mark.parametrize(
    "start",
    [
        lambda coro, loop, name, ctx: eager.eager_task(coro, loop, name, ctx, task=_EagerTask),
        eager.by_hand,
    ],
    ids=["the 3.12 branch", "the 3.11 branch"],
)
async def test_each_branch_runs_the_first_step_at_once_in_the_context_and_no_task_if_done(start):
    context = contextvars.copy_context()
    context.run(WHO.set, "the request")
    log: list[str] = []
    loop = asyncio.get_running_loop()
    assert start(_steps(log, waits=False), loop, "tierchain-heartbeats", context) is None
    assert log == ["first step as the request"]  # ran before start returned, no task

    log.clear()
    task = start(_steps(log, waits=True), loop, "tierchain-heartbeats", context)
    assert log == ["first step as the request"]  # the first step, at once
    assert task is not None
    assert task.get_name() == "tierchain-heartbeats"
    await task
    assert log == ["first step as the request", "second step as the request"]


async def test_the_312_branch_asks_the_task_class_for_an_eager_start_with_name_and_context():
    _EagerTask.made.clear()
    context = contextvars.copy_context()
    loop = asyncio.get_running_loop()
    eager.eager_task(
        _steps([], waits=False), loop, "tierchain-heartbeats", context, task=_EagerTask
    )
    assert _EagerTask.made == [
        {"loop": loop, "name": "tierchain-heartbeats", "context": context, "eager_start": True}
    ]


async def test_a_cancellation_of_the_rest_reaches_the_coroutine_started_by_hand():
    log: list[str] = []

    async def coro() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            log.append("cancelled inside")
            raise

    loop = asyncio.get_running_loop()
    task = eager.by_hand(coro(), loop, "t", contextvars.copy_context())
    assert task is not None
    await asyncio.sleep(0)  # the rest is under way, awaiting through _Resume
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["cancelled inside"]


def test_the_running_interpreter_picks_the_branch_it_has():
    expected = eager.eager_task if sys.version_info >= (3, 12) else eager.by_hand
    assert eager._START is expected


async def test_finished_tells_a_closed_coroutine_from_one_still_out():
    async def once() -> None:
        await asyncio.sleep(0)

    coro = once()
    assert not eager.finished(coro)  # created, not run
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)
    assert not eager.finished(coro)  # suspended at its wait
    await task
    assert eager.finished(coro)
