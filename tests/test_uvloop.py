"""The whole stack on uvloop, the event loop ``uvicorn[standard]`` runs on.

tierchain keeps some timers of its own per event loop (the deadlines Budget and
the watchdog share, the disconnect watch, the keepalive clock); they must not
rely on anything only asyncio's own loop has.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tierchain import Budget, TierRequest
from tierchain._runtime import deadlines as _deadlines

from .support import answering, one_request, whole_stack

uvloop = pytest.importorskip("uvloop")


def on_uvloop(coro: Any) -> Any:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def test_the_whole_stack_answers_on_uvloop():
    async def main() -> list[list[dict[str, Any]]]:
        app = whole_stack(answering("raises"))
        return [await one_request(app) for _ in range(3)]

    for sent in on_uvloop(main()):
        assert sent[0]["status"] == 200
        assert dict(sent[0]["headers"])[b"x-tierchain-attempts"] == (
            b"tower;outcome=connect_refused, hosted;outcome=ok"
        )
        assert b"".join(m.get("body", b"") for m in sent[1:]).endswith(b"data: [DONE]\n\n")


def test_a_deadline_fires_on_time_on_uvloop():
    async def main() -> float:
        fired: list[float] = []
        start = time.monotonic()
        _deadlines.schedule(0.02, lambda: fired.append(time.monotonic()))
        await asyncio.sleep(0.1)
        assert len(fired) == 1
        return fired[0] - start

    assert 0.019 <= on_uvloop(main()) < 0.09


def test_a_spent_budget_answers_504_on_uvloop():
    async def slow(scope: Any, receive: Any, send: Any) -> None:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            assert TierRequest.of(scope).cancel_reason == "budget_exhausted"
            raise

    async def main() -> list[dict[str, Any]]:
        return await one_request(Budget(slow, default=0.03))

    sent = on_uvloop(main())
    assert sent[0]["status"] == 504
