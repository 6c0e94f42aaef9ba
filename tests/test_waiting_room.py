"""The waiting room (issue 22 item 6), over real sockets.

Every replica of a pool is full (``max_in_flight`` reached): a request waits at
the gateway, first come first served within a priority band, is let go the
moment a lease frees, and says where it stands in ``queued`` state lines.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx

from tierchain import (
    Backend,
    Budget,
    Failover,
    Forwarder,
    Pool,
    Routes,
    TierRequest,
)

from .support import Exchange, FakeBackend, chat_request, serve, streams


class Gate:
    """A replica script that holds each answer until its own event is set."""

    def __init__(self) -> None:
        self.arrived: list[asyncio.Event] = []
        self.go: list[asyncio.Event] = []
        self.bodies: list[bytes] = []
        self.any = asyncio.Event()
        self.free: bytes | None = None  # a request whose body holds this is answered at once

    def script(self) -> Callable[[Exchange], Any]:
        async def script(ex: Exchange) -> None:
            go = asyncio.Event()
            self.go.append(go)
            self.bodies.append(ex.request.body)
            self.any.set()
            if self.free is None or self.free not in ex.request.body:
                await go.wait()
            await streams(["ok"])(ex)

        return script

    async def next_arrival(self) -> None:
        self.any.clear()
        await self.any.wait()


class Gateway:
    def __init__(self, pool: Pool, **failover: Any) -> None:
        self.forwarder = Forwarder()
        app: Any = Failover(
            self.forwarder, routes=Routes({"echo": [pool]}), waiting_room=True, **failover
        )
        app = Budget(app)  # a budget only for a request that asks (X-Request-Timeout)
        self.events: list[dict[str, Any]] = []
        inner = app

        async def recorded(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                TierRequest.of(scope).subscribe(self.events.append)
            await inner(scope, receive, send)

        self.app = recorded

    async def aclose(self) -> None:
        await self.forwarder.aclose()

    def queued(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["state"] == "queued"]


def two_full_replicas(a: FakeBackend, b: FakeBackend) -> Pool:
    return Pool(
        name="tower",
        backends=[
            Backend(name="tower-a", url=a.url, max_in_flight=1),
            Backend(name="tower-b", url=b.url, max_in_flight=1),
        ],
    )


async def post(client: httpx.AsyncClient, url: str, what: str, **headers: str) -> httpx.Response:
    body = chat_request(stream=True, content=what)
    return await client.post(url + "/v1/chat/completions", content=body, headers=headers)


async def until(check: Callable[[], bool]) -> None:
    """Let the event loop run until ``check()`` (the gateway runs in this loop)."""
    for _ in range(2000):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("never happened")


async def fill(client: httpx.AsyncClient, url: str, gate: Gate) -> list[asyncio.Task[Any]]:
    """One held request at each replica."""
    held = []
    for i in range(2):
        arrival = asyncio.create_task(gate.next_arrival())
        held.append(asyncio.create_task(post(client, url, f"held {i}")))
        await arrival
    return held


async def test_a_request_waits_at_the_gateway_while_every_replica_is_full() -> None:
    gate = Gate()
    async with FakeBackend("a") as a, FakeBackend("b") as b:
        a.script = b.script = gate.script()
        gw = Gateway(two_full_replicas(a, b))
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=10) as client:
            held = await fill(client, url, gate)
            waiting = asyncio.create_task(post(client, url, "waiting"))
            await until(lambda: bool(gw.queued()))
            assert len(a.requests) + len(b.requests) == 2  # nothing piled onto a full replica
            gate.go[0].set()  # one held answer ends: its lease frees
            arrival = asyncio.create_task(gate.next_arrival())
            await arrival
            assert b"waiting" in gate.bodies[-1]
            for go in gate.go:
                go.set()
            responses = [await t for t in (*held, waiting)]
        await gw.aclose()
    assert [r.status_code for r in responses] == [200, 200, 200]
    [queued] = gw.queued()
    assert (queued["position"], queued["waiting"], queued["band"]) == (1, 1, "normal")
    assert len(a.requests) + len(b.requests) == 3


async def test_first_come_first_served_within_a_band_and_a_higher_band_goes_first() -> None:
    gate = Gate()
    async with FakeBackend("a") as a, FakeBackend("b") as b:
        a.script = b.script = gate.script()
        gw = Gateway(two_full_replicas(a, b), priority_header="X-Priority")
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=10) as client:
            held = await fill(client, url, gate)
            first = asyncio.create_task(post(client, url, "first"))
            await until(lambda: len(gw.queued()) == 1)
            second = asyncio.create_task(post(client, url, "second"))
            await until(lambda: len(gw.queued()) == 2)
            urgent = asyncio.create_task(post(client, url, "urgent", **{"X-Priority": "high"}))
            await until(lambda: len(gw.queued()) == 3)
            order = []
            for i in range(3):
                arrival = asyncio.create_task(gate.next_arrival())
                gate.go[i].set()
                await arrival
                order.append(gate.bodies[-1])
            for go in gate.go:
                go.set()
            for task in (*held, first, second, urgent):
                assert (await task).status_code == 200
        await gw.aclose()
    assert [next(w for w in ("urgent", "first", "second") if w.encode() in b) for b in order] == [
        "urgent",
        "first",
        "second",
    ]
    urgent_line = next(e for e in gw.queued() if e["band"] == "high")
    assert urgent_line["position"] == 1  # it went in ahead of the two already waiting


async def test_a_spent_budget_ends_the_wait_with_a_504() -> None:
    gate = Gate()
    async with FakeBackend("a") as a, FakeBackend("b") as b:
        a.script = b.script = gate.script()
        gw = Gateway(two_full_replicas(a, b))
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=10) as client:
            held = await fill(client, url, gate)
            r = await post(client, url, "waiting", **{"X-Request-Timeout": "0.5"})
            for go in gate.go:
                go.set()
            for task in held:
                await task
        await gw.aclose()
    assert r.status_code == 504
    assert gw.queued()
    assert len(a.requests) + len(b.requests) == 2  # it never reached a replica


async def test_after_max_wait_with_every_replica_still_full_the_request_gets_503() -> None:
    gate = Gate()
    async with FakeBackend("a") as a, FakeBackend("b") as b:
        a.script = b.script = gate.script()
        gw = Gateway(two_full_replicas(a, b), max_wait=0.3)
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=10) as client:
            held = await fill(client, url, gate)
            waiting = await post(client, url, "waiting")
            for go in gate.go:
                go.set()
            for task in held:
                assert (await task).status_code == 200
        await gw.aclose()
    assert len(gw.queued()) == 1
    assert waiting.status_code == 503  # never sent on to a full replica
    assert waiting.headers["retry-after"] == "1"
    assert waiting.json()["error"]["code"] == "max_wait"
    assert len(a.requests) + len(b.requests) == 2


async def test_a_route_with_a_backend_that_cannot_say_it_is_full_never_waits() -> None:
    async with FakeBackend("a") as a, FakeBackend("b") as b:
        pool = Pool(
            name="tower",
            backends=[
                Backend(name="tower-a", url=a.url, max_in_flight=1),
                Backend(name="tower-b", url=b.url),  # no limit, no status: never known full
            ],
        )
        gw = Gateway(pool)
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=10) as client:
            r = await post(client, url, "straight on")
        await gw.aclose()
    assert r.status_code == 200
    assert gw.queued() == []


async def test_a_waiting_stream_hears_its_place_in_line_as_a_heartbeat_line() -> None:
    import json

    from tierchain import Heartbeats

    gate = Gate()
    gate.free = b"waiting"
    async with FakeBackend("a") as a, FakeBackend("b") as b:
        a.script = b.script = gate.script()
        forwarder = Forwarder()
        failover = Failover(
            forwarder, routes=Routes({"echo": [two_full_replicas(a, b)]}), waiting_room=True
        )
        app = Heartbeats(failover, commit_after=0.05, interval=0)
        async with serve(app) as url, httpx.AsyncClient(timeout=10) as client:
            held = await fill(client, url, gate)
            body = chat_request(stream=True, content="waiting")
            async with client.stream("POST", url + "/v1/chat/completions", content=body) as r:
                raw = b""
                released = False
                async for chunk in r.aiter_raw():
                    raw += chunk
                    if not released and b'"state":"queued"' in raw:
                        released = True
                        gate.go[0].set()  # a lease frees: the waiting stream goes on and ends
            for go in gate.go:
                go.set()
            for task in held:
                assert (await task).status_code == 200
        await forwarder.aclose()
    lines = [json.loads(line[2:]) for line in raw.decode().splitlines() if line.startswith(": {")]
    queued = next(line for line in lines if line["state"] == "queued")
    assert (queued["position"], queued["waiting"]) == (1, 1)
    assert [line["state"] for line in lines][-1] == "generating"
