"""The gateway's own slowness is not the backend's failure; idle connections do not pile up."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from httpcore import AnyIOBackend

from tierchain import Backend, Breaker, Failover, Forwarder, Routes
from tierchain import forwarder as forwarder_module
from tierchain._connections import FlatTransport

from .support import Exchange, FakeBackend, answers, chat_request, serve, streams

BODY = chat_request(stream=False)


def stack(tower: str, hosted: str, forwarder: Forwarder) -> Any:
    """Tower then hosted, a breaker that opens on the first failure."""
    routes = Routes({"echo": [Backend("tower", tower), Backend("hosted", hosted)]})
    return Failover(Breaker(forwarder, failure_threshold=1), routes=routes)


async def post(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5) as client:
        return await client.post(url + "/v1/chat/completions", content=BODY)


@asynccontextmanager
async def lagging_connect(port: int, seconds: float) -> AsyncIterator[None]:
    """The gateway's first connect to ``port`` starts after its event loop was blocked."""
    # The network backend the Forwarder's pool connects with (tierchain._connections).
    real = AnyIOBackend.connect_tcp
    blocked_once = False

    async def blocked(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal blocked_once
        if kwargs.get("port") == port and not blocked_once:
            blocked_once = True
            await asyncio.sleep(0.1)  # the loop's lag monitor has a tick behind it
            time.sleep(seconds)  # noqa: ASYNC251 - an overloaded loop: nothing else runs
            await asyncio.sleep(0)  # the loop's next turn (and the overdue timers)
        return await real(self, *args, **kwargs)

    AnyIOBackend.connect_tcp = blocked  # type: ignore[method-assign]
    try:
        yield
    finally:
        AnyIOBackend.connect_tcp = real  # type: ignore[method-assign]


async def test_a_connect_window_the_gateway_loop_lost_is_given_again():
    ok = answers(200, b'{"choices":[]}')
    async with FakeBackend("tower", ok) as tower, FakeBackend("hosted", ok) as hosted:
        forwarder = Forwarder(connect_timeout=0.2)
        app = stack(tower.url, hosted.url, forwarder)
        async with serve(app) as url, lagging_connect(tower.port, 0.5):
            first = await post(url)
        await forwarder.aclose()
    # The loop stood still for longer than the connect timeout: the tower was not
    # late, the gateway was, so the tower got a fresh window and answered.
    assert first.headers["x-tierchain-attempts"] == "tower;outcome=ok"
    assert hosted.requests == []


async def test_lag_beyond_the_patience_fails_over_but_leaves_the_breaker_closed(
    caplog, monkeypatch
):
    monkeypatch.setattr(forwarder_module, "_EXTENSIONS", 0)  # no second window
    ok = answers(200, b'{"choices":[]}')
    async with FakeBackend("tower", ok) as tower, FakeBackend("hosted", ok) as hosted:
        forwarder = Forwarder(connect_timeout=0.2)
        app = stack(tower.url, hosted.url, forwarder)
        async with serve(app) as url:
            async with lagging_connect(tower.port, 0.5):
                first = await post(url)
            second = await post(url)
        await forwarder.aclose()
    assert first.status_code == 200  # the chain advanced to hosted...
    assert first.headers["x-tierchain-attempts"] == (
        "tower;outcome=connect_timeout, hosted;outcome=ok"
    )
    assert "forward.gateway_overloaded" in caplog.text
    # ...but the tower's breaker did not count it: the next request goes to the tower.
    assert second.headers["x-tierchain-attempts"] == "tower;outcome=ok"


async def test_a_connect_timeout_with_a_punctual_loop_is_the_backends_and_counts():
    # A listening socket whose backlog is full: the kernel never completes the connect.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(0)
    fillers = []
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(sock.getsockname())
        except BlockingIOError:
            pass
        fillers.append(s)
    tower = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        async with FakeBackend("hosted", answers(200, b'{"choices":[]}')) as hosted:
            forwarder = Forwarder(connect_timeout=0.2)
            app = stack(tower, hosted.url, forwarder)
            async with serve(app) as url:
                first = await post(url)
                second = await post(url)
            await forwarder.aclose()
    finally:
        for s in [*fillers, sock]:
            s.close()
    assert first.headers["x-tierchain-attempts"] == (
        "tower;outcome=connect_timeout, hosted;outcome=ok"
    )
    # It counted: the tower's breaker is open.
    assert second.headers["x-tierchain-attempts"].startswith("tower;outcome=skipped")


async def test_a_wait_for_a_pooled_connection_is_the_gateways_and_does_not_count():
    release = asyncio.Event()

    async def held_then_ok(ex: Exchange) -> None:
        if not seen.is_set():
            seen.set()
            await release.wait()
        await ex.respond(200, b'{"choices":[]}')

    seen = asyncio.Event()
    async with (
        FakeBackend("tower", held_then_ok) as tower,
        FakeBackend("hosted", answers(200, b'{"choices":[]}')) as hosted,
    ):
        # The caller's own client: one connection per host, and it is taken.
        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=1))
        forwarder = Forwarder(connect_timeout=0.2, client=client)
        app = stack(tower.url, hosted.url, forwarder)
        async with serve(app) as url:
            hog = asyncio.create_task(post(url))
            async with asyncio.timeout(2):
                await seen.wait()
            waited = await post(url)
            release.set()
            await hog
            after = await post(url)
        await client.aclose()
    # (httpx's max_connections is for the whole client: hosted waits as well.)
    assert waited.headers["x-tierchain-attempts"] == (
        "tower;outcome=pool_timeout, hosted;outcome=pool_timeout"
    )
    assert after.headers["x-tierchain-attempts"] == "tower;outcome=ok"  # breakers stayed closed


def sockets_to(port: int) -> int:
    """This process's open TCP sockets whose remote end is loopback ``port``.

    Counted by socket, not by fd total: other tests' servers and clients in the
    same process may open or close fds of their own meanwhile.
    """
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == port and fields[9] in inodes:
                count += 1
    return count


@pytest.mark.skipif(not os.path.isdir("/proc/self/net"), reason="needs /proc")
async def test_idle_pooled_connections_close_after_keepalive_expiry_and_fds_come_back():
    async with FakeBackend("tower", streams(["a", "b"])) as tower:
        transport = FlatTransport(limits=httpx.Limits(keepalive_expiry=0.1))
        async with httpx.AsyncClient(transport=transport) as client:
            for _ in range(3):
                async with asyncio.timeout(2):
                    response = await client.post(tower.url + "/v1/chat/completions", content=BODY)
                assert response.status_code == 200
            assert tower.open_connections == 1  # one connection, kept alive and reused
            pool: Any = transport._pool
            assert pool.connections == 1
            assert sockets_to(tower.port) == 1
            async with asyncio.timeout(1):
                while tower.open_connections:  # noqa: ASYNC110 - polls the fake's count
                    await asyncio.sleep(0.02)
            assert pool.connections == 0
            assert sockets_to(tower.port) == 0  # the client's socket is closed, not just idle
