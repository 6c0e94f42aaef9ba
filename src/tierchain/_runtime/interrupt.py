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

Layers subclass it (their per-request objects already exist, so it costs no allocation),
or hold one. Nothing outside ``tierchain._runtime`` calls ``cancelling`` or ``uncancel``
(``tests/test_internals.py`` checks).
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["Interruption"]


class Interruption:
    """One task's interruption: armed on entry, fired at most once, judged on the way out."""

    __slots__ = ("_baseline", "_task", "interrupted")

    def __init__(self) -> None:
        self._task: asyncio.Task[Any] | None = None
        self._baseline = 0
        self.interrupted = False

    def arm(self, task: asyncio.Task[Any] | None = None) -> asyncio.Task[Any]:
        """Take the running task (or ``task``) and its cancellation count as the baseline."""
        if task is None:
            task = asyncio.current_task()
            assert task is not None, "an Interruption is armed inside a task"
        self._task = task
        self._baseline = task.cancelling()
        self.interrupted = False
        return task

    @property
    def armed(self) -> bool:
        return self._task is not None

    def interrupt(self, reason: str | None = None) -> None:
        """Cancel the armed task with ``reason`` (once; a no-op before :meth:`arm`)."""
        task = self._task
        if task is None or self.interrupted:
            return
        self.interrupted = True
        task.cancel(reason)

    def ours(self) -> bool:
        """In ``except CancelledError``: was it this interruption, with nothing else pending?

        True undoes it (the caller then answers instead of re-raising), and the
        interruption may fire again; False means the cancellation must go on.
        """
        task = self._task
        if not self.interrupted or task is None:
            return False
        if task.uncancel() > self._baseline:
            return False  # another cancellation is pending: it goes on
        self.interrupted = False
        return True

    def swallowed(self) -> bool:
        """After the inner code returned: True when it swallowed this interruption (undone now)."""
        task = self._task
        if self.interrupted and task is not None and task.cancelling() > self._baseline:
            task.uncancel()
            self.interrupted = False
            return True
        return False
