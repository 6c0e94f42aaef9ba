"""A request's young phase (``_disconnect.Young``): one deadline for its first ``WATCH_AFTER``.

Heartbeats' first commit or keepalive, Budget's end and Failover's disconnect guard each
had a deadline of their own, armed as the request came in and almost always cancelled
unfired. The outermost of Heartbeats and Budget now starts the request's young phase:
an answer over within ``WATCH_AFTER`` arms that one deadline and nothing else; a request
that lives longer gets each layer's deadline at exactly the time it had before.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tierchain import TierRequest
from tierchain._disconnect import WATCH_AFTER
from tierchain._runtime import deadlines

from .support import busy_for, chat_scope, on_virtual_time, one_request, whole_stack


def _pending() -> dict[int, deadlines.Deadline]:
    return dict(deadlines._TIMERS.get().pending)


def _owners(before: dict[int, deadlines.Deadline]) -> dict[str, float]:
    """The request's pending deadlines (those not pending before it): owner's class -> due."""
    return {
        type(getattr(entry.callback, "__self__", entry.callback)).__name__: entry.due
        for seq, entry in _pending().items()
        if seq not in before
    }


def _handler(seen: list[dict[str, str | float]], before: dict[int, Any], *, lives: float = 0):
    async def handler(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        if lives:
            await asyncio.sleep(lives)
        seen.append(_owners(before))
        start = {"type": "http.response.start", "status": 200}
        await send({**start, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return handler


@on_virtual_time
async def test_an_answer_over_within_watch_after_arms_only_the_young_phase():
    before = _pending()
    seen: list[dict[str, Any]] = []
    scope = chat_scope()
    sent = await one_request(whole_stack(_handler(seen, before)), scope)
    assert sent[0]["status"] == 200
    started = scope["tierchain.request"].started
    # No Heartbeats commit, no Budget end, no disconnect guard of its own: one deadline.
    assert seen == [{"Young": started + WATCH_AFTER}]
    assert _owners(before) == {}  # and none is left once the request is over
    assert scope["tierchain.request"].young is None


@on_virtual_time
async def test_a_request_that_lives_gets_each_timer_at_exactly_its_own_time():
    before = _pending()
    seen: list[dict[str, Any]] = []
    scope = chat_scope()
    await one_request(whole_stack(_handler(seen, before, lives=0.05)), scope)
    req: TierRequest = scope["tierchain.request"]
    owners = seen[0]
    assert "Young" not in owners  # over
    # As they were armed before the phase: Heartbeats' commit_after (1 s) from the
    # request's start, Budget's default (60 s) from its own start (the same reading).
    assert owners["_Stream"] == req.started + 1.0
    assert owners["_Spend"] == req.started + 60.0
    assert _owners(before) == {}


@on_virtual_time
async def test_a_budget_shorter_than_watch_after_is_timed_at_once():
    before = _pending()
    seen: list[dict[str, Any]] = []
    scope = chat_scope()
    scope["headers"] = [*scope["headers"], (b"x-request-timeout", b"0.01")]
    await one_request(whole_stack(_handler(seen, before)), scope)
    req: TierRequest = scope["tierchain.request"]
    assert seen[0]["_Spend"] == req.started + 0.01
    assert "_Stream" not in seen[0]  # the commit (1 s) still waits for the phase


@on_virtual_time
async def test_a_guard_entered_later_than_the_phase_keeps_its_own_watch_after():
    # The body took 10 ms to arrive: the guard's WATCH_AFTER is from its own entry, not
    # from the phase's start (which it would join only within the scheduler's EARLY).
    before = _pending()
    seen: list[dict[str, Any]] = []
    scope = chat_scope()
    app = whole_stack(_handler(seen, before))
    body = b'{"model": "m", "stream": true}'
    gave = False

    async def receive() -> dict[str, Any]:
        nonlocal gave
        if gave:
            await asyncio.Event().wait()
        gave = True
        busy_for(0.01)
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    await app(scope, receive, send)
    started = scope["tierchain.request"].started
    assert seen[0] == {
        "Young": started + WATCH_AFTER,
        "DisconnectGuard": started + 0.01 + WATCH_AFTER,
    }
