"""Forwarder on its own and inside a chain: headers, timeouts, lifecycle."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest
from asgi_lifespan import LifespanManager

from tierchain import Backend, Failover, Forwarder, Routes
from tierchain._disconnect import WATCH_AFTER

from .support import (
    Exchange,
    FakeBackend,
    chat_request,
    now,
    on_virtual_time,
    openai_stream,
    refused_url,
    serve,
    streams,
)


@pytest.fixture
def blackhole():
    """A loopback port whose accept queue is full: new connections hang in SYN."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    for _ in range(8):  # fill the backlog so later SYNs are dropped
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(s)
    yield f"http://127.0.0.1:{port}"
    for s in fillers:
        s.close()
    server.close()


@on_virtual_time
async def test_a_backend_that_never_accepts_costs_the_connect_timeout_then_fails_over(blackhole):
    async with FakeBackend("hosted", streams(["ok"])) as hosted:
        forwarder = Forwarder(connect_timeout=0.2)
        app = Failover(
            forwarder,
            routes=Routes({"echo": [Backend("tower", blackhole), Backend("hosted", hosted.url)]}),
        )
        async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
            t0 = now()
            response = await client.post(url + "/v1/chat/completions", content=chat_request())
            took = now() - t0
        await forwarder.aclose()
    assert response.status_code == 200
    assert response.headers["x-tierchain-attempts"].startswith("tower;outcome=connect_timeout")
    assert took == pytest.approx(0.2, abs=1e-6)  # the connect timeout, then hosted at once


@on_virtual_time
async def test_hop_by_hop_headers_are_dropped_and_backend_headers_and_model_are_applied():
    async with FakeBackend("hosted", streams(["ok"])) as hosted:
        backend = Backend(
            "hosted", hosted.url, headers={"Authorization": "Bearer sk-up"}, model="gpt-x"
        )
        forwarder = Forwarder()
        app = Failover(forwarder, routes=Routes({"echo": [backend]}))
        async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
            response = await client.post(
                url + "/v1/chat/completions?trace=1",
                content=chat_request(),
                headers={
                    "connection": "keep-alive, x-private",
                    "x-private": "drop me",
                    "te": "trailers",
                    "authorization": "Bearer caller",
                    "x-keep": "yes",
                    "accept-encoding": "gzip",
                },
            )
        await forwarder.aclose()
    assert response.status_code == 200
    seen = hosted.requests[0]
    assert seen.path == "/v1/chat/completions?trace=1"
    assert "x-private" not in seen.headers
    assert "te" not in seen.headers
    assert seen.headers["x-keep"] == "yes"
    assert seen.headers["authorization"] == "Bearer sk-up"
    assert seen.headers["accept-encoding"] == "identity"
    assert json.loads(seen.body)["model"] == "gpt-x"
    assert "transfer-encoding" not in {k for k in response.headers if k != "transfer-encoding"}


@on_virtual_time
async def test_a_forwarder_alone_answers_502_for_a_dead_backend():
    forwarder = Forwarder(backend=Backend("tower", refused_url()))
    async with serve(forwarder) as url, httpx.AsyncClient(timeout=5) as client:
        response = await client.post(url + "/v1/chat/completions", content=chat_request())
    await forwarder.aclose()
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "connect_refused"


@on_virtual_time
async def test_a_forwarder_alone_streams_and_ends_a_broken_stream_with_an_error_event():
    first, second = openai_stream(["one", "two"])[:2]

    async def dies(ex: Exchange) -> None:
        await ex.head()
        await ex.write(first + second[:-12])  # a whole event, then most of one
        await ex.reset()

    async with FakeBackend("tower", dies) as tower:
        forwarder = Forwarder(backend=Backend("tower", tower.url))
        async with serve(forwarder) as url, httpx.AsyncClient(timeout=5) as client:
            response = await client.post(url + "/v1/chat/completions", content=chat_request())
        await forwarder.aclose()
    # The whole event, then the error event: the half one never reaches the caller.
    assert response.content.startswith(first + b'data: {"error":')
    assert b'"two"' not in response.content
    assert b'"code":"stream_broken"' in response.content


@on_virtual_time
async def test_the_forwarder_closes_its_client_on_lifespan_shutdown():
    async with FakeBackend("tower") as tower:
        forwarder = Forwarder(backend=Backend("tower", tower.url))
        async with LifespanManager(forwarder) as manager:
            transport = httpx.ASGITransport(app=manager.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                await client.post("/", content=b"{}")
            assert forwarder._client is not None
        assert forwarder._client is None
        await asyncio.wait_for(tower.connection_closed.wait(), 1)
        assert tower.open_connections == 0


@on_virtual_time
async def test_a_stream_that_dies_after_commit_raises_api_error_in_the_openai_sdk():
    async def dies_after_two(ex: Exchange) -> None:
        await ex.head()
        events = openai_stream(["a", "b"])
        await ex.write(events[0])
        await ex.write(events[1])
        await ex.reset()

    async with FakeBackend("tower", dies_after_two) as tower, FakeBackend("hosted") as hosted:
        forwarder = Forwarder()
        app = Failover(
            forwarder,
            routes=Routes({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]}),
            continuations=0,  # (hosted would finish it: tests/test_continuation.py)
        )
        async with serve(app) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            got = []
            with pytest.raises(openai.APIError, match="failed mid-stream"):
                stream = await client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": "hi"}], stream=True
                )
                async for chunk in stream:
                    got.append(chunk.choices[0].delta.content)
            await client.close()
        await forwarder.aclose()
    assert got == ["a", "b"]
    assert hosted.requests == []


@on_virtual_time
async def test_a_caller_that_leaves_while_the_backend_is_silent_closes_the_upstream():
    arrived = asyncio.Event()

    async def silent(ex: Exchange) -> None:
        arrived.set()
        await ex.wait_closed_by_peer()

    async with FakeBackend("tower", silent) as tower:
        forwarder = Forwarder()
        app = Failover(forwarder, routes=Routes({"echo": [Backend("tower", tower.url)]}))
        async with serve(app) as url:
            async with httpx.AsyncClient(timeout=5) as client:
                request = asyncio.create_task(
                    client.post(url + "/v1/chat/completions", content=chat_request())
                )
                await asyncio.wait_for(arrived.wait(), 1)
                request.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await request
            t0 = now()
            await asyncio.wait_for(tower.connection_closed.wait(), 1)
            # Closed at the disconnect watch's first look after the caller left.
            assert now() - t0 <= WATCH_AFTER + 1e-6
        await forwarder.aclose()
    assert tower.open_connections == 0
    leftovers = [t for t in asyncio.all_tasks() if t.get_name().startswith("tierchain")]
    assert leftovers == []
