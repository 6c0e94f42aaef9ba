"""Cancel one task with a reason, and tell afterwards whether a cancellation was this one.

This is the bookkeeping of ``asyncio.Timeout`` (Python 3.11), without its loop timer: the
layers that interrupt an attempt or a request (Budget, the watchdog, Failover's abort and
send timeout, the disconnect guard, the body deadline) time themselves on the shared
scheduler, and share only this rule. On :meth:`Interruption.arm` the task's
``cancelling()`` count is the baseline; :meth:`interrupt` cancels the task once, with its
reason as the message; in ``except CancelledError``, :meth:`ours` is True only when the
cancellation was this one and ``uncancel()`` brings the count back to the baseline (any
other cancellation pending, a shutdown or an outer layer's, goes on); and when the inner
code swallowed the cancellation and returned, :meth:`swallowed` undoes it.

Layers hold one (``cut``, on Budget's, the watchdog's and the disconnect guard's
per-request objects), never subclass it: the runtime's fields stay the runtime's. It has
no ``__init__`` (a new one is made in C, for the cost of an empty object): :meth:`arm`
sets every field, and nothing else may be used before it. Nothing outside
``tierchain._runtime`` calls ``cancelling`` or ``uncancel`` (``tests/test_internals.py``
checks).
"""

from __future__ import annotations

import asyncio
import sys
from asyncio import get_running_loop
from collections.abc import Callable
from typing import Any

# The running task, with no Python frame: 3.11's ``asyncio.current_task`` is a Python
# function around this table of the C module's (3.12's is C itself). Three interruptions
# are armed per request, each would pay that frame. A private name, on purpose
# (docs/internals.md, "Private parts of other packages"; tests/test_dependency_internals.py).
_CURRENT: dict[Any, asyncio.Task[Any]] | None = (
    None if sys.version_info >= (3, 12) else getattr(asyncio.tasks, "_current_tasks", None)
)
# The running task of a loop, in one call: the table's own get (3.11), or current_task.
_task_of: Callable[[asyncio.AbstractEventLoop], asyncio.Task[Any] | None] = (
    asyncio.current_task if _CURRENT is None else _CURRENT.get
)

__all__ = ["Interruption"]


class Interruption:
    """One task's interruption: armed on entry, fired at most once, judged on the way out."""

    __slots__ = ("_baseline", "_task", "interrupted")

    _task: asyncio.Task[Any]
    _baseline: int
    interrupted: bool

    @classmethod
    def on(cls, task: asyncio.Task[Any] | None = None) -> Interruption:
        """A new interruption armed on ``task`` (default: the running task)."""
        if task is None:
            task = _task_of(get_running_loop())
            assert task is not None, "an Interruption is armed inside a task"
        made = cls()
        made._task = task
        made._baseline = task.cancelling()
        made.interrupted = False
        return made

    @classmethod
    def beside(cls, other: Interruption) -> Interruption:
        """A new interruption of ``other``'s task with ``other``'s baseline (armed at once)."""
        made = cls()
        made._task = other._task
        made._baseline = other._baseline
        made.interrupted = False
        return made

    @property
    def task(self) -> asyncio.Task[Any] | None:
        """The task this interruption cancels, once armed (None before)."""
        return getattr(self, "_task", None)

    def arm(self, task: asyncio.Task[Any] | None = None) -> asyncio.Task[Any]:
        """Take the running task (or ``task``) and its cancellation count as the baseline."""
        if task is None:
            task = _task_of(get_running_loop())
            assert task is not None, "an Interruption is armed inside a task"
        self._task = task
        self._baseline = task.cancelling()
        self.interrupted = False
        return task

    def interrupt(self, reason: str | None = None) -> None:
        """Cancel the armed task with ``reason`` (once)."""
        if not self.interrupted:
            self.interrupted = True
            self._task.cancel(reason)

    def ours(self) -> bool:
        """In ``except CancelledError``: was it this interruption, with nothing else pending?

        True undoes it (the caller then answers instead of re-raising), and the
        interruption may fire again; False means the cancellation must go on.
        """
        if not self.interrupted:
            return False
        if self._task.uncancel() > self._baseline:
            return False  # another cancellation is pending: it goes on
        self.interrupted = False
        return True

    def swallowed(self) -> bool:
        """After the inner code returned: True when it swallowed this interruption (undone now)."""
        task = self._task
        if self.interrupted and task.cancelling() > self._baseline:
            task.uncancel()
            self.interrupted = False
            return True
        return False
