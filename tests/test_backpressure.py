"""A caller's backpressure is the caller's (issue 24, item 3).

A caller that stops reading keeps the gateway's send to it out. Meanwhile
nothing is read from the upstream, so the upstream's silence is not its own:
the watchdog never calls it a stall, the caller is cut after Failover's
``send_timeout`` (outcome ``caller_stalled``, neutral for the breaker), and
its in-flight lease and Shed slot are given back at once.

Over real sockets: uvicorn in front, a tower on a loopback socket that streams
far more than the socket buffers hold, and callers with a small receive
buffer that send a streaming request and never read.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tierchain import (
    Backend,
    Breaker,
    Budget,
    Failover,
    Forwarder,
    Heartbeats,
    MemoryStore,
    PreferBackend,
    RedisStore,
    Routes,
    SaturationWatchdog,
    Shed,
)
from tierchain.observer import Observer
from tierchain.request import Attempt, TierRequest

from .support import (
    Exchange,
    FakeBackend,
    chat_request,
    chat_scope,
    chunk_event,
    on_virtual_time,
    openai_stream,
    serve,
    until,
)

CALLERS = 5
SEND_TIMEOUT = 0.5
STALL_AFTER = 0.2  # shorter than the send timeout: a stall would be found first
EVENT = chunk_event("x" * 16_000)  # one 16 KB event


async def floods(ex: Exchange, *, after: float = 0.0) -> None:
    """A tower that streams until the gateway hangs up (far more than any buffer),
    its first event ``after`` seconds after its head."""
    await ex.head()
    if after:
        await asyncio.sleep(after)
    for _ in range(4096):  # 64 MB at most
        await ex.write(EVENT)
    for event in openai_stream(["end"]):
        await ex.write(event)
    await ex.end()


@contextlib.asynccontextmanager
async def silent_callers(url: str, n: int) -> AsyncIterator[list[socket.socket]]:
    """``n`` callers that send a streaming request and never read a byte."""
    host, port = url.removeprefix("http://").split(":")
    body = chat_request(stream=True)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
            await asyncio.get_running_loop().sock_sendall(sock, head + body)
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close()


class Gateway:
    """The README's stack, Shed in front, a tower with max_in_flight and a paid tier."""

    def __init__(
        self,
        store: Any,
        tower: str,
        hosted: str,
        *,
        send_timeout: float = SEND_TIMEOUT,
        budget: float = 60.0,
        commit_after: float = 1.0,
    ) -> None:
        self.store = store
        self.forwarder = Forwarder()
        self.watchdog = SaturationWatchdog(self.forwarder, stall_after=STALL_AFTER)
        breaker = Breaker(self.watchdog, store=store, failure_threshold=CALLERS)
        routes = Routes(
            {
                "echo": [
                    Backend("tower", tower, max_in_flight=CALLERS * 2),
                    Backend("hosted", hosted),
                ]
            }
        )
        failover = Failover(breaker, routes=routes, store=store, send_timeout=send_timeout)
        heartbeats = Heartbeats(
            Budget(PreferBackend(failover), default=budget),
            interval=10.0,
            commit_after=commit_after,
        )
        self.shed = Shed(heartbeats, max_concurrent=CALLERS + 1)
        self.app = self.shed

    async def aclose(self) -> None:
        await self.forwarder.aclose()
        await self.watchdog.aclose()


@pytest.fixture(params=["memory", "redis"])
async def store(request: Any) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield MemoryStore()
        return
    server = request.getfixturevalue("redis_server")
    redis = RedisStore(server.url)
    try:
        yield redis
    finally:
        await redis.aclose()


@pytest.mark.parametrize(
    ("http", "heartbeats_first"),
    [("h11", False), ("httptools", False), ("h11", True)],
    ids=["h11", "httptools", "heartbeats-committed"],
)
async def test_callers_that_stop_reading_are_cut_without_blaming_the_tower(
    store: Any, http: str, heartbeats_first: bool, metric: Any
) -> None:
    """Five callers that stop reading leave the tower's breaker closed and every lease
    at 0; a caller that reads is answered by the tower afterwards. (With
    ``heartbeats_first``, Heartbeats has committed the response itself before the
    tower's first event.)"""
    cut_before = metric("tierchain_callers_cut_total", route="echo", backend="tower")
    stalled_before = metric(
        "tierchain_attempts_total", route="echo", backend="tower", outcome="stalled"
    )

    async def script(ex: Exchange) -> None:
        await floods(ex, after=0.3 if heartbeats_first else 0.0)

    async with (
        FakeBackend("tower", script) as tower,
        FakeBackend("hosted") as hosted,
    ):
        gw = Gateway(store, tower.url, hosted.url, commit_after=0.05 if heartbeats_first else 1.0)
        async with serve(gw.app, http=http) as url, silent_callers(url, CALLERS):

            async def all_cut() -> bool:
                cut = metric("tierchain_callers_cut_total", route="echo", backend="tower")
                return cut - cut_before == CALLERS

            await until(all_cut, "every silent caller cut")

            async def leases_back() -> bool:
                return await store.lease_count("tower") == 0 and gw.shed.in_flight == 0

            # Cut while their sockets are still open: every lease and Shed slot is back.
            await until(leases_back, "every lease and Shed slot given back")
            snapshot = await store.breaker_snapshot("echo", "tower")
            assert snapshot.state == "closed"
            assert snapshot.failures == 0
            stalled = metric(
                "tierchain_attempts_total", route="echo", backend="tower", outcome="stalled"
            )
            assert stalled == stalled_before  # the watchdog never blamed the tower
            # A caller that reads is answered by the tower, as before.
            tower.script = _short_stream
            async with httpx.AsyncClient(timeout=10) as client:
                answer = await client.post(
                    url + "/v1/chat/completions", content=chat_request(stream=True)
                )
        await gw.aclose()
    assert answer.status_code == 200
    # The tower's events, byte for byte, and hosted never asked. (The tower's name is in the
    # head unless Heartbeats committed it first: with ``heartbeats_first`` it does so 50 ms
    # in, which a loaded machine's tower may not beat.)
    assert answer.content.endswith(b"".join(openai_stream(["Hel", "lo"])))
    assert hosted.requests == []
    if heartbeats_first:
        assert answer.headers.get("x-tierchain-backend", "tower") == "tower"
    else:
        assert answer.headers["x-tierchain-backend"] == "tower"


@on_virtual_time
async def test_the_budget_ending_a_caller_that_stopped_reading_is_bounded_and_no_stall(
    metric: Any,
) -> None:
    """The budget ends streams whose callers stopped reading: the tower is not charged
    with a stall, and the budget's error event, which those callers never take, is
    bounded by send_timeout: every lease and Shed slot comes back."""
    store = MemoryStore()
    cut_before = metric("tierchain_callers_cut_total", route="echo", backend="tower")
    spent_before = metric(
        "tierchain_attempts_total", route="echo", backend="tower", outcome="budget_exhausted"
    )
    async with FakeBackend("tower", floods) as tower, FakeBackend("hosted") as hosted:
        # The budget ends each stream while its send to the caller is out, well before
        # send_timeout would; its error event then waits on the same caller.
        gw = Gateway(store, tower.url, hosted.url, send_timeout=1.0, budget=0.5)
        async with serve(gw.app) as url, silent_callers(url, CALLERS):

            async def all_cut() -> bool:
                cut = metric("tierchain_callers_cut_total", route="echo", backend="tower")
                return cut - cut_before == CALLERS and gw.shed.in_flight == 0

            await until(all_cut, "every silent caller cut at its budget's error event")
            assert await store.lease_count("tower") == 0
            snapshot = await store.breaker_snapshot("echo", "tower")
            assert (snapshot.state, snapshot.failures) == ("closed", 0)
        await gw.aclose()
    spent = metric(
        "tierchain_attempts_total", route="echo", backend="tower", outcome="budget_exhausted"
    )
    assert spent - spent_before == CALLERS


async def _short_stream(ex: Exchange) -> None:
    await ex.head()
    for event in openai_stream(["Hel", "lo"]):
        await ex.write(event)
    await ex.end()


# -- the stall judgement itself, in memory ------------------------------------------


async def test_the_stall_gap_is_not_judged_while_a_send_to_the_caller_is_out() -> None:
    """A stream whose upstream is quiet only because the caller is not taking our send
    is never stalled; once the send comes back, the gap is timed from then."""
    released = asyncio.Event()
    seen: list[str] = []

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        req = TierRequest.of(scope)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": EVENT, "more_body": True})
        # The caller does not take the next chunk: the send stays out for three
        # stall windows.
        req.caller_blocked_since = time.monotonic()
        await released.wait()
        req.caller_blocked_since = None
        req.caller_unblocked_at = time.monotonic()
        seen.append("released")
        # Three windows since the last event, half of one since the send came back.
        await asyncio.sleep(STALL_AFTER / 2)
        for event in openai_stream(["end"]):
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    watchdog = SaturationWatchdog(handler, stall_after=STALL_AFTER)
    scope: dict[str, Any] = {"type": "http", "method": "POST", "path": "/v1/chat/completions"}
    req = TierRequest.of(scope)
    req.attempt = Attempt(1, 1, Backend("tower", "http://127.0.0.1:9"), "echo")
    req.observer = Observer()
    req.in_chain = True
    sent: list[Any] = []

    async def send(message: Any) -> None:
        observer = req.observer
        assert observer is not None
        if message["type"] == "http.response.start":
            observer.start(message["status"], message["headers"])
        else:
            observer.body(message.get("body", b""))
            if not message.get("more_body", False):
                observer.end()
        sent.append(message)

    async def receive() -> Any:
        await asyncio.Event().wait()

    async def release_later() -> None:
        await asyncio.sleep(STALL_AFTER * 3)
        released.set()

    releaser = asyncio.create_task(release_later())
    try:
        await watchdog(scope, receive, send)  # raises StreamError("stalled") if judged
    finally:
        await releaser
        await watchdog.aclose()
    assert seen == ["released"]
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


async def test_the_lease_goes_back_before_the_final_error_event_and_that_write_is_bounded(
    metric: Any,
) -> None:
    """A backend breaks mid-stream; the caller does not take the error event: the
    lease is already back while that write waits, and the write is cut at
    send_timeout (CallerStalled) instead of holding the request forever."""
    from tierchain.errors import BackendUnavailable, CallerStalled

    store = MemoryStore()
    tower = Backend("tower", "http://127.0.0.1:9", max_in_flight=1)

    async def breaks_mid_stream(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        start = {"type": "http.response.start", "status": 200}
        await send({**start, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": EVENT, "more_body": True})
        TierRequest.of(scope).attempt_error = BackendUnavailable(
            "the stream broke", reason="stream_broken"
        )

    app = Failover(
        breaks_mid_stream, routes=Routes({"echo": [tower]}), store=store, send_timeout=0.3
    )
    waiting = asyncio.Event()
    leases_while_waiting: list[int] = []

    async def send(message: Any) -> None:
        if b'"error"' in message.get("body", b""):
            leases_while_waiting.append(await store.lease_count("tower"))
            waiting.set()
            await asyncio.Event().wait()  # a caller that never takes it

    body = chat_request(stream=True)
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Any:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()

    scope = chat_scope()
    cut_before = metric("tierchain_callers_cut_total", route="echo", backend="tower")
    with pytest.raises(CallerStalled):
        async with asyncio.timeout(30):  # (a hang guard: unbounded, this never returns)
            await app(scope, receive, send)
    assert waiting.is_set()
    assert leases_while_waiting == [0]
    assert metric("tierchain_callers_cut_total", route="echo", backend="tower") == cut_before + 1
    req = TierRequest.of(scope)
    assert [(r.backend, r.outcome) for r in req.attempts] == [("tower", "stream_broken")]
