"""Admission per backend: a full backend is skipped at once, and busy is not a failure."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tierchain import (
    Backend,
    Breaker,
    Failover,
    Forwarder,
    Heartbeats,
    MemoryStore,
    RedisStore,
    Routes,
    TierRequest,
)
from tierchain.admission import Admission

from .support import (
    Exchange,
    FakeBackend,
    chat_request,
    now,
    on_virtual_time,
    openai_stream,
    serve,
    streams,
)

HOSTED = b"".join(openai_stream(["from ", "hosted"]))


def held(release: asyncio.Event, started: asyncio.Event) -> Any:
    """A tower script that says it started, then streams once ``release`` is set."""

    async def script(ex: Exchange) -> None:
        started.set()
        await release.wait()
        await streams(["from ", "tower"])(ex)

    return script


class Gateway:
    """Failover (-> Breaker) -> Forwarder, every state event recorded with its time."""

    def __init__(self, chain: list[Backend], *, breaker: Breaker | None = None, **opts: Any):
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.forwarder = Forwarder()
        inner: Any = self.forwarder
        if breaker is not None:
            breaker.app = inner
            inner = breaker
        self.failover = Failover(inner, routes=Routes({"echo": chain}), **opts)

        async def app(scope, receive, send):
            if scope["type"] == "http":
                TierRequest.of(scope).subscribe(lambda e: self.events.append((now(), e)))
            await self.failover(scope, receive, send)

        self.app = app

    def states(self, name: str) -> list[dict[str, Any]]:
        return [e for _, e in self.events if e["state"] == name]

    async def aclose(self) -> None:
        await self.forwarder.aclose()
        await self.failover.admission.aclose()


async def post(client: httpx.AsyncClient, url: str) -> httpx.Response:
    return await client.post(url + "/v1/chat/completions", content=chat_request())


@on_virtual_time
async def test_a_full_backend_is_skipped_at_once_and_the_chain_advances(metric):
    release, started = asyncio.Event(), asyncio.Event()
    busy_before = metric(
        "tierchain_backend_busy_total", route="echo", backend="tower", why="max_in_flight"
    )
    async with (
        FakeBackend("tower", held(release, started)) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        gw = Gateway([Backend("tower", tower.url, max_in_flight=1), Backend("hosted", hosted.url)])
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=5) as client:
            first = asyncio.create_task(post(client, url))
            await asyncio.wait_for(started.wait(), 2)
            assert metric("tierchain_backend_in_flight", backend="tower") == 1
            gw.events.clear()
            second = await post(client, url)
            release.set()
            first_response = await first
        await gw.aclose()
    assert second.content == HOSTED
    assert second.headers["x-tierchain-attempts"] == "tower;outcome=busy, hosted;outcome=ok"
    assert first_response.content == b"".join(openai_stream(["from ", "tower"]))
    assert len(tower.requests) == 1  # the busy attempt sent nothing
    assert gw.states("backend_busy") == [
        {"state": "backend_busy", "backend": "tower", "in_flight": 1, "failing_over": True}
    ]
    times = {e["state"] + str(e.get("n", "")): t for t, e in gw.events}
    assert times["attempt2"] - times["attempt1"] < 0.025  # 5 ms, with slack for a busy machine
    assert metric("tierchain_backend_in_flight", backend="tower") == 0
    after = metric(
        "tierchain_backend_busy_total", route="echo", backend="tower", why="max_in_flight"
    )
    assert after == busy_before + 1


@on_virtual_time
async def test_the_busy_state_line_reaches_the_caller_as_an_sse_comment():
    release, started = asyncio.Event(), asyncio.Event()
    async with (
        FakeBackend("tower", held(release, started)) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        forwarder = Forwarder()
        failover = Failover(
            forwarder,
            routes=Routes(
                {
                    "echo": [
                        Backend("tower", tower.url, max_in_flight=1),
                        Backend("hosted", hosted.url),
                    ]
                }
            ),
        )
        app = Heartbeats(failover)
        async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
            first = asyncio.create_task(post(client, url))
            await asyncio.wait_for(started.wait(), 2)
            second = await post(client, url)
            release.set()
            await first
        await forwarder.aclose()
    line = b': {"state":"backend_busy","backend":"tower","in_flight":1,"failing_over":true}\n'
    assert line in second.content


@on_virtual_time
async def test_the_last_tier_is_never_skipped_for_being_full_it_queues():
    release, started, both = asyncio.Event(), asyncio.Event(), asyncio.Event()
    arrived = 0

    async def script(ex: Exchange) -> None:
        nonlocal arrived
        arrived += 1
        if arrived == 2:
            both.set()
        await held(release, started)(ex)

    async with FakeBackend("tower", script) as tower:
        gw = Gateway([Backend("tower", tower.url, max_in_flight=1)])
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=5) as client:
            first = asyncio.create_task(post(client, url))
            await asyncio.wait_for(started.wait(), 2)
            second = asyncio.create_task(post(client, url))
            await asyncio.wait_for(both.wait(), 2)
            release.set()
            responses = await asyncio.gather(first, second)
        await gw.aclose()
    tower_answer = b"".join(openai_stream(["from ", "tower"]))
    assert [r.content for r in responses] == [tower_answer, tower_answer]
    assert gw.states("backend_busy") == []


@on_virtual_time
async def test_busy_is_not_a_failure_no_breaker_ledger_counts_it(manual_clock):
    store = MemoryStore(clock=manual_clock)
    release, started = asyncio.Event(), asyncio.Event()
    async with (
        FakeBackend("tower", held(release, started)) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        breaker = Breaker(None, store=store, failure_threshold=1, saturation_threshold=1)
        gw = Gateway(
            [Backend("tower", tower.url, max_in_flight=1), Backend("hosted", hosted.url)],
            breaker=breaker,
            store=store,
        )
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=5) as client:
            first = asyncio.create_task(post(client, url))
            await asyncio.wait_for(started.wait(), 2)
            for _ in range(3):
                assert (await post(client, url)).content == HOSTED
            release.set()
            await first
        await gw.aclose()
    snap = await store.breaker_snapshot("echo", "tower")
    assert (snap.state, snap.failures, snap.saturations) == ("closed", 0, 0)
    assert len(gw.states("backend_busy")) == 3


async def test_replicas_sharing_a_redis_store_count_in_flight_together(redis_server):
    release, started = asyncio.Event(), asyncio.Event()
    store_a, store_b = RedisStore(redis_server.url), RedisStore(redis_server.url)
    async with (
        FakeBackend("tower", held(release, started)) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        chain = [Backend("tower", tower.url, max_in_flight=1), Backend("hosted", hosted.url)]
        a, b = Gateway(chain, store=store_a), Gateway(chain, store=store_b)
        async with (
            serve(a.app) as url_a,
            serve(b.app) as url_b,
            httpx.AsyncClient(timeout=5) as client,
        ):
            first = asyncio.create_task(post(client, url_a))
            await asyncio.wait_for(started.wait(), 2)
            assert await b.failover.admission.in_flight("tower") == 1
            second = await post(client, url_b)
            release.set()
            await first
        await a.aclose()
        await b.aclose()
        assert await store_a.lease_count("tower") == 0  # given back at the end
    await store_a.aclose()
    await store_b.aclose()
    assert second.headers["x-tierchain-attempts"] == "tower;outcome=busy, hosted;outcome=ok"
    assert b.states("backend_busy")[0]["in_flight"] == 1


# -- the leases, on each store ----------------------------------------------------------


async def test_leases_count_to_the_limit_and_a_dead_replicas_run_out(breaker_store, manual_clock):
    store = breaker_store
    assert await store.lease_acquire("tower", "a-1", 2, 30.0) == (True, 1)
    assert await store.lease_acquire("tower", "a-2", 2, 30.0) == (True, 2)
    assert await store.lease_acquire("tower", "b-1", 2, 30.0) == (False, 2)
    assert await store.lease_acquire("tower", "b-2", 2, 30.0, force=True) == (True, 3)
    assert await store.lease_count("other") == 0
    await store.lease_release("tower", "b-2")
    manual_clock.advance(20)
    await store.lease_renew("tower", ["a-1"], 30.0)  # a-1's replica lives; a-2's died
    manual_clock.advance(15)
    assert await store.lease_count("tower") == 1
    assert await store.lease_acquire("tower", "b-3", 2, 30.0) == (True, 2)
    await store.lease_release("tower", "a-1")
    await store.lease_release("tower", "a-1")  # twice is harmless
    assert await store.lease_count("tower") == 1


@on_virtual_time
async def test_admission_renews_its_leases_while_an_attempt_runs():
    store = MemoryStore()
    admission = Admission(store, lease=0.09)
    lease = await admission.enter(
        Backend("tower", "http://127.0.0.1:1", max_in_flight=1), last=False
    )
    assert lease is not None
    await asyncio.sleep(0.2)  # over two lease lives: renewed every 30 ms
    assert await store.lease_count("tower") == 1
    await admission.leave(lease)
    assert await store.lease_count("tower") == 0
    await admission.aclose()


@on_virtual_time
async def test_a_backend_without_a_limit_takes_no_lease():
    admission = Admission()
    assert await admission.enter(Backend("tower", "http://127.0.0.1:1"), last=False) is None


def test_max_in_flight_is_validated():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="max_in_flight"):
            Backend("tower", "http://127.0.0.1:1", max_in_flight=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lease"):
        Admission(lease=0)
    assert json.dumps(Backend("t", "http://127.0.0.1:1", max_in_flight=3).max_in_flight) == "3"


def test_the_routes_file_sets_max_in_flight_and_names_a_bad_one():
    from tierchain.config import ConfigError, routes_from_toml

    def table(limit: Any) -> dict[str, Any]:
        backend = {"name": "tower", "url": "http://127.0.0.1:1", "max_in_flight": limit}
        return {"routes": {"echo": {"backends": [backend]}}}

    assert routes_from_toml(table(2))["echo"][0].max_in_flight == 2
    with pytest.raises(ConfigError, match=r"routes\.echo\.backends\[0\]\.max_in_flight=0"):
        routes_from_toml(table(0))
