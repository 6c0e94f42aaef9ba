"""A finished request leaves nothing for the garbage collector.

Every object a request makes through the whole stack must be freed by
reference counting the moment the request ends. A reference cycle (a callback
that points back at its owner, an exception whose traceback holds the frame
that keeps it) keeps the request's whole object graph alive until the next
collection, and makes the collector run often and long at high request rates.
"""

from __future__ import annotations

import asyncio
import gc
from collections import Counter
from typing import Any

import pytest

from tierchain import (
    Backend,
    Breaker,
    Budget,
    Failover,
    Heartbeats,
    PreferBackend,
    Routes,
    SaturationWatchdog,
    current_attempt,
)
from tierchain.errors import BackendUnavailable

ROUTES = Routes(
    {"m": [Backend("tower", "http://127.0.0.1:9"), Backend("hosted", "http://127.0.0.1:9")]}
)
BODY = b'{"model": "m", "stream": true}'


def whole_stack(app: Any) -> Any:
    app = SaturationWatchdog(app, slow_after=30.0)
    app = Breaker(app, failure_threshold=10**6)
    app = Failover(app, routes=ROUTES)
    app = PreferBackend(app)
    app = Budget(app, default=60.0)
    return Heartbeats(app, interval=10.0)


def answering(tower: str) -> Any:
    """A backend handler: hosted streams one event and [DONE]; the tower does ``tower``."""

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        if current_attempt(scope).backend.name == "tower":
            if tower == "raises":
                raise BackendUnavailable("connection refused", reason="connect_refused")
            if tower == "503":
                await send({"type": "http.response.start", "status": 503, "headers": []})
                await send({"type": "http.response.body", "body": b'{"error": "busy"}'})
                return
        start = {"type": "http.response.start", "status": 200}
        await send({**start, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return handler


async def one_request(app: Any) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    messages = iter([{"type": "http.request", "body": BODY, "more_body": False}])
    over = asyncio.Event()

    async def receive() -> dict[str, Any]:
        message = next(messages, None)
        if message is None:  # as a server does: nothing more until the caller leaves
            await over.wait()
            return {"type": "http.disconnect"}
        return message

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
    }
    await app(scope, receive, send)
    over.set()
    await asyncio.sleep(0)  # the loop's turn between requests, as a server gives it
    return sent


@pytest.mark.parametrize("tower", ["answers", "raises", "503"])
async def test_a_request_through_the_whole_stack_leaves_no_reference_cycle(tower):
    app = whole_stack(answering(tower))
    await one_request(app)  # warm: first-use caches are not per-request garbage
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        sent = [await one_request(app) for _ in range(20)]
        gc.collect()
        left = Counter(type(o).__qualname__ for o in gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()
    assert all(s[0]["status"] == 200 for s in sent), sent[0]
    assert all(b"data: [DONE]" in b"".join(m.get("body", b"") for m in s) for s in sent)
    assert left == Counter(), f"objects left in reference cycles: {left.most_common(8)}"
