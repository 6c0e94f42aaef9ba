"""The waiting room bounded (issue 33): its size, one key's share, who may jump the line,
and callers let go no faster than the backend admits them."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tierchain import Backend, Failover, Forwarder, Routes
from tierchain.keys import CallerKey, CallerKeys

from .support import Exchange, FakeBackend, chat_request, on_virtual_time, serve, streams
from .test_waiting_room import Gate, Gateway, fill, post, two_full_replicas, until

ALICE = "sk-gw-alice-0123456789abcdef"
BOB = "sk-gw-bob-0123456789abcdef00"
BOSS = "sk-gw-boss-0123456789abcdef0"


def keyed(gw: Gateway) -> Any:
    return CallerKeys(
        gw.app,
        keys=[
            CallerKey("alice", ALICE),
            CallerKey("bob", BOB),
            CallerKey("boss", BOSS, priority=True),
        ],
    )


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_past_max_waiting_a_new_request_gets_503_with_retry_after_at_once(metric) -> None:
    gate = Gate()
    before = metric("tierchain_waiting_room_refused_total", route="echo", reason="full")
    async with FakeBackend("a") as a, FakeBackend("b") as b:
        a.script = b.script = gate.script()
        gw = Gateway(two_full_replicas(a, b), max_waiting=1)
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=10) as client:
            held = await fill(client, url, gate)
            first = asyncio.create_task(post(client, url, "first"))
            await until(lambda: len(gw.queued()) == 1)
            second = await post(client, url, "second")
            for go in gate.go:
                go.set()
            gate.free = b""  # later arrivals are answered at once
            for task in (*held, first):
                assert (await task).status_code == 200
        await gw.aclose()
    assert second.status_code == 503
    assert second.headers["retry-after"] == "3"  # a tenth of max_wait (30 s)
    assert second.json()["error"]["code"] == "full"
    assert metric("tierchain_waiting_room_refused_total", route="echo", reason="full") == before + 1


async def test_one_key_past_its_share_of_the_room_gets_429_while_another_key_still_waits() -> None:
    gate = Gate()
    async with FakeBackend("a") as a, FakeBackend("b") as b:
        a.script = b.script = gate.script()
        gw = Gateway(two_full_replicas(a, b), max_waiting=4, waiting_key_share=0.25)
        app = keyed(gw)
        async with serve(app) as url, httpx.AsyncClient(timeout=10) as client:
            held = []
            for i in range(2):
                arrival = asyncio.create_task(gate.next_arrival())
                held.append(asyncio.create_task(post(client, url, f"held {i}", **bearer(BOSS))))
                await arrival
            alice_1 = asyncio.create_task(post(client, url, "alice 1", **bearer(ALICE)))
            await until(lambda: len(gw.queued()) == 1)
            alice_2 = await post(client, url, "alice 2", **bearer(ALICE))
            bob = asyncio.create_task(post(client, url, "bob", **bearer(BOB)))
            await until(lambda: len(gw.queued()) == 2)
            gate.free = b""
            for go in gate.go:
                go.set()
            for task in (*held, alice_1, bob):
                assert (await task).status_code == 200
        await gw.aclose()
    assert alice_2.status_code == 429
    assert alice_2.headers["retry-after"] == "3"
    assert alice_2.json()["error"]["code"] == "key_share"


async def test_only_a_key_allowed_priority_can_jump_the_line() -> None:
    gate = Gate()
    async with FakeBackend("a") as a, FakeBackend("b") as b:
        a.script = b.script = gate.script()
        gw = Gateway(two_full_replicas(a, b), priority_header="X-Priority")
        app = keyed(gw)
        async with serve(app) as url, httpx.AsyncClient(timeout=10) as client:
            held = []
            for i in range(2):
                arrival = asyncio.create_task(gate.next_arrival())
                held.append(asyncio.create_task(post(client, url, f"held {i}", **bearer(BOB))))
                await arrival
            first = asyncio.create_task(post(client, url, "first", **bearer(BOB)))
            await until(lambda: len(gw.queued()) == 1)
            pushy = asyncio.create_task(
                post(client, url, "pushy", **bearer(ALICE), **{"X-Priority": "high"})
            )
            await until(lambda: len(gw.queued()) == 2)
            boss = asyncio.create_task(
                post(client, url, "boss", **bearer(BOSS), **{"X-Priority": "high"})
            )
            await until(lambda: len(gw.queued()) == 3)
            order = []
            for i in range(3):
                arrival = asyncio.create_task(gate.next_arrival())
                gate.go[i].set()
                await arrival
                order.append(gate.bodies[-1])
            for go in gate.go:
                go.set()
            for task in (*held, first, pushy, boss):
                assert (await task).status_code == 200
        await gw.aclose()
    names = ("boss", "first", "pushy")
    assert [next(w for w in names if w.encode() in b) for b in order] == ["boss", "first", "pushy"]
    pushy_line = next(e for e in gw.queued() if e["position"] == 2 and e["waiting"] == 2)
    assert pushy_line["band"] == "normal"  # its "high" was not honoured


@on_virtual_time
async def test_waiters_whose_max_wait_runs_out_never_land_on_a_full_backend_at_once() -> None:
    """The audit's herd: 58 waiters let go at once at a backend limited to one at a time."""
    in_flight = 0
    most = 0
    release = asyncio.Event()
    arrived = asyncio.Event()

    async def one_at_a_time(ex: Exchange) -> None:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        arrived.set()
        try:
            await release.wait()
            await streams(["ok"])(ex)
        finally:
            in_flight -= 1

    async with FakeBackend("hosted", one_at_a_time) as hosted:
        forwarder = Forwarder()
        app = Failover(
            forwarder,
            routes=Routes({"echo": [Backend("hosted", hosted.url, max_in_flight=1)]}),
            waiting_room=True,
            max_wait=2.0,
        )
        async with serve(app) as url, httpx.AsyncClient(timeout=30) as client:

            async def ask() -> httpx.Response:
                return await client.post(url + "/v1/chat/completions", content=chat_request())

            first = asyncio.create_task(ask())
            await arrived.wait()
            waiters = [asyncio.create_task(ask()) for _ in range(20)]
            answers = [await w for w in waiters]
            release.set()
            assert (await first).status_code == 200
        await forwarder.aclose()
    assert most == 1
    assert len(hosted.requests) == 1
    assert {r.status_code for r in answers} == {503}
    assert all(r.headers["retry-after"] for r in answers)
