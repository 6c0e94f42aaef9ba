"""RedisStore against a real redis-server: replicas share the breaker; Redis may go away."""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
import pytest

from tierchain import (
    Backend,
    Breaker,
    Failover,
    Forwarder,
    RedisStore,
    Routes,
)
from tierchain.store import BreakerPolicy
from tierchain.testing import VirtualClock, virtual_time

from .support import (
    RULES_TIMEOUT,
    FakeBackend,
    RedisRelay,
    SaturateAfter,
    chat_request,
    now,
    on_virtual_time,
    serve,
    streams,
)

pytestmark = pytest.mark.redis

POLICY = BreakerPolicy()
T = TypeVar("T")


async def _silent(ex) -> None:
    """A saturated GPU: accepts the request, says 200 and pings, never sends a token."""
    await ex.head()
    await ex.write(b": ping\n\n")
    await ex.wait_closed_by_peer()


def replica(routes: Routes, store: RedisStore) -> tuple[Failover, Forwarder]:
    """One gateway replica: Failover(Breaker(watchdog(Forwarder())))."""
    import tierchain

    forwarder = Forwarder()
    watchdog = getattr(tierchain, "SaturationWatchdog", None)
    inner = (
        watchdog(forwarder, slow_after=0.3, suspect_for=0)  # (the breaker shared, alone)
        if watchdog is not None
        else SaturateAfter(forwarder, 0.3)
    )
    return Failover(Breaker(inner, store=store), routes=routes), forwarder


async def post(client: httpx.AsyncClient, url: str) -> httpx.Response:
    return await client.post(url + "/v1/chat/completions", content=chat_request())


@on_virtual_time
async def test_a_saturation_seen_by_one_replica_is_honoured_by_the_other(
    redis_server, manual_clock
):
    # On virtual time the tower's 0.3 s window runs out only while every task waits, so
    # each request has reached the tower before the watchdog can call it saturated; the
    # relay keeps Redis's own pace out of that clock, and both replicas share manual_clock.
    async with (
        FakeBackend("tower", _silent) as tower,
        FakeBackend("hosted", streams(["ok"])) as hosted,
        RedisRelay(redis_server.port) as relay,
        RedisStore(relay.url, clock=manual_clock, timeout=RULES_TIMEOUT) as store_a,
        RedisStore(relay.url, clock=manual_clock, timeout=RULES_TIMEOUT) as store_b,
    ):
        routes = Routes({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]})
        app_a, fwd_a = replica(routes, store_a)
        app_b, fwd_b = replica(routes, store_b)
        async with (
            serve(app_a) as url_a,
            serve(app_b) as url_b,
            httpx.AsyncClient(timeout=5) as client,
        ):
            for _ in range(2):
                response = await post(client, url_a)
                assert response.headers["x-tierchain-attempts"].startswith(
                    "tower;outcome=saturated"
                )
            sent_to_tower = len(tower.requests)
            response = await post(client, url_b)
        await fwd_a.aclose()
        await fwd_b.aclose()
        snapshot = await store_b.breaker_snapshot("echo", "tower")
    assert response.status_code == 200
    assert response.headers["x-tierchain-attempts"] == "tower;outcome=skipped, hosted;outcome=ok"
    assert len(tower.requests) == sent_to_tower  # the tower's 0.3 s wait was not paid
    assert len(tower.requests) == 2
    assert snapshot.state == "open"
    assert snapshot.retry_in == pytest.approx(POLICY.saturation_cooldown)


async def test_two_replicas_never_both_take_the_half_open_probe(redis_server):
    clock = [1_000_000.0]
    async with (
        RedisStore(redis_server.url, clock=lambda: clock[0], timeout=RULES_TIMEOUT) as a,
        RedisStore(redis_server.url, clock=lambda: clock[0], timeout=RULES_TIMEOUT) as b,
    ):
        for _ in range(2):
            ticket = await a.breaker_acquire("echo", "tower", POLICY)
            await a.breaker_record("echo", "tower", POLICY, "saturation", gen=ticket.gen)
        clock[0] += 900
        tickets = await asyncio.gather(
            *(s.breaker_acquire("echo", "tower", POLICY) for s in [a, b] * 50)
        )
    assert sum(t.admitted for t in tickets) == 1
    assert sum(bool(t.probe) for t in tickets) == 1


async def test_keys_are_namespaced_and_expire(redis_server):
    import redis.asyncio as aioredis

    async with RedisStore(redis_server.url, ttl=60, timeout=RULES_TIMEOUT) as store:
        for _ in range(2):
            ticket = await store.breaker_acquire("echo", "tower:1", POLICY)
            await store.breaker_record("echo", "tower:1", POLICY, "saturation", gen=ticket.gen)
        await store.set_pin("echo", "hosted", 30)
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        keys = sorted(await client.keys("*"))
        ttls = [await client.pttl(k) for k in keys]
    finally:
        await client.aclose()
    assert keys == ["tierchain:breaker:echo:tower%3A1", "tierchain:pin:echo"]
    assert 900_000 < ttls[0] <= 960_000  # the cooldown, then the idle ttl
    assert 0 < ttls[1] <= 30_000


def _on_virtual_time_beside_redis(test: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
    """``on_virtual_time`` for a test whose stores reach redis-server itself (no relay).

    An idle loop waits up to RULES_TIMEOUT of real time (not a few milliseconds) for
    redis-server before its clock jumps to the next timer, so the virtual clock never runs
    ahead of real time while Redis answers, and it still stands still while the loop is busy.
    """

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> Any:
        clock = VirtualClock(grace=RULES_TIMEOUT)
        with virtual_time(clock), asyncio.Runner(loop_factory=clock.new_event_loop) as runner:
            return runner.run(test(*args, **kwargs))

    return run


@_on_virtual_time_beside_redis
async def test_redis_going_away_fails_no_request_and_it_comes_back_by_itself(redis_server, caplog):
    # The outage is Redis killed (connections refused), never a late reply: RULES_TIMEOUT
    # keeps a busy machine's slow answer from counting as a second outage and a second return.
    caplog.set_level(logging.INFO, logger="tierchain")
    async with (
        FakeBackend("tower", streams(["from ", "tower"])) as tower,
        FakeBackend("hosted", streams(["ok"])) as hosted,
        RedisStore(redis_server.url, timeout=RULES_TIMEOUT, reconnect_every=0.1) as store,
        RedisStore(redis_server.url, timeout=RULES_TIMEOUT) as other_replica,
    ):
        routes = Routes({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]})
        app, forwarder = replica(routes, store)
        async with serve(app) as url, httpx.AsyncClient(timeout=RULES_TIMEOUT) as client:
            assert (await post(client, url)).status_code == 200
            redis_server.kill()
            statuses = []
            started = now()
            for _ in range(20):
                statuses.append((await post(client, url)).status_code)
            took = now() - started
            assert store.degraded
            redis_server.start()  # same port
            await asyncio.sleep(store.reconnect_every)  # virtual: Redis may be tried again
            assert (await post(client, url)).status_code == 200
            assert not store.degraded
            # Shared again: a trip recorded through another replica is honoured here.
            for _ in range(2):
                ticket = await other_replica.breaker_acquire("echo", "tower", POLICY)
                await other_replica.breaker_record(
                    "echo", "tower", POLICY, "saturation", gen=ticket.gen
                )
            response = await post(client, url)
        await forwarder.aclose()
    assert statuses == [200] * 20
    # On the package clock, which moves only while every task waits on a timer, the twenty
    # requests took less than one Redis timeout: none waited for Redis to answer.
    assert took < store.timeout
    assert response.headers["x-tierchain-backend"] == "hosted"
    warnings = [r for r in caplog.records if getattr(r, "event", "") == "store.redis_unavailable"]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING
    assert "ConnectionError" in warnings[0].tierchain["error"]  # refused, not timed out
    back = [r for r in caplog.records if getattr(r, "event", "") == "store.redis_reconnected"]
    assert len(back) == 1


async def test_the_fallback_keeps_a_breaker_working_while_redis_is_away(redis_server):
    async with RedisStore(redis_server.url, reconnect_every=60) as store:
        redis_server.kill()
        for _ in range(2):
            ticket = await store.breaker_acquire("echo", "tower", POLICY)
            await store.breaker_record("echo", "tower", POLICY, "saturation", gen=ticket.gen)
        assert not (await store.breaker_acquire("echo", "tower", POLICY)).admitted
        assert (await store.breaker_snapshot("echo", "tower")).state == "open"
        assert await store.get_pin("echo") is None
        assert await store.list_pins() == {}


async def test_a_pin_write_while_redis_is_away_says_so(redis_server):
    from tierchain.redis_store import StoreUnavailable

    async with RedisStore(redis_server.url) as store:
        redis_server.kill()
        with pytest.raises(StoreUnavailable, match="not set"):
            await store.set_pin("echo", "hosted", 60)
        with pytest.raises(StoreUnavailable, match="not removed"):
            await store.delete_pin("echo")


def test_redis_store_imports_without_redis_and_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "redis" or m.startswith("redis.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "redis", None)
    from tierchain import RedisStore as Imported

    with pytest.raises(ImportError, match=r"tierchain\[redis\]"):
        Imported()


@on_virtual_time
async def test_a_cancelled_acquire_gives_back_the_probe_slot_it_took(redis_server, manual_clock):
    async with (
        RedisRelay(redis_server.port) as relay,
        RedisStore(relay.url, clock=manual_clock) as store,
        RedisStore(relay.url, clock=manual_clock) as other_replica,
    ):
        for _ in range(2):
            ticket = await store.breaker_acquire("echo", "tower", POLICY)
            await store.breaker_record("echo", "tower", POLICY, "saturation", gen=ticket.gen)
        manual_clock.advance(900)
        relay.hold_next()
        task = asyncio.create_task(store.breaker_acquire("echo", "tower", POLICY))
        await relay.held.wait()  # Redis ran the script: the slot is taken, the answer not read
        assert not (await other_replica.breaker_acquire("echo", "tower", POLICY)).admitted
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        relay.release()  # the store reads the answer after all, and hands the slot back
        ticket = await _first(
            lambda: store.breaker_acquire("echo", "tower", POLICY), lambda t: t.admitted
        )
    assert ticket.probe


async def _first(call: Callable[[], Awaitable[T]], ok: Callable[[T], bool]) -> T:
    """``call()`` again until its answer is ``ok``: waits for something the store does in the
    background. On virtual time each pause ends only once every other task is waiting, so
    the bound (RULES_TIMEOUT) is reached only if that never happens."""
    async with asyncio.timeout(RULES_TIMEOUT):
        while True:
            answer = await call()
            if ok(answer):
                return answer
            await asyncio.sleep(0.01)


@on_virtual_time
async def test_a_late_reply_is_not_sent_again_so_one_outcome_counts_once(redis_server, caplog):
    # Seen on a loaded CI machine: a record whose reply came after the timeout
    # was retried, Redis ran the script twice, and one failure counted as two.
    # On virtual time behind the relay, only the reply the test holds back is late.
    caplog.set_level(logging.INFO, logger="tierchain")
    async with (
        RedisRelay(redis_server.port) as relay,
        RedisStore(relay.url, timeout=0.05, reconnect_every=0.01) as store,
        RedisStore(relay.url) as reader,
    ):
        ticket = await store.breaker_acquire("echo", "tower", POLICY)
        await store.breaker_record("echo", "tower", POLICY, "neutral", gen=ticket.gen)  # loads it
        relay.hold_next()
        started = now()
        change = await store.breaker_record("echo", "tower", POLICY, "failure", gen=ticket.gen)
        took = now() - started
        assert relay.held.is_set()  # Redis ran it and answered; the answer is still held
        assert took == pytest.approx(store.timeout, abs=1e-6)  # given up at the timeout
        assert change.failures == 1  # counted on the local fallback meanwhile
        assert store.degraded
        relay.release()  # the late answer arrives, at a connection the store has dropped
        shared = await reader.breaker_snapshot("echo", "tower")
    assert shared.failures == 1  # Redis ran it once; it was not sent a second time
    events = [getattr(r, "event", "") for r in caplog.records]
    assert events.count("store.redis_unavailable") == 1


@on_virtual_time
async def test_the_wait_before_redis_is_tried_again_runs_on_the_package_clock():
    # Nothing listens on the port: the first call falls back to memory. Redis is tried again
    # after reconnect_every on the package's one clock (virtual here), not on time.monotonic.
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with RedisStore(f"redis://127.0.0.1:{port}/0", reconnect_every=60) as store:
        await store.breaker_acquire("echo", "tower", POLICY)
        assert store.degraded
        assert store._local() is not None  # within reconnect_every: the fallback serves
        await asyncio.sleep(60)  # virtual: the clock jumps, no real time passes
        assert store._local() is None  # this caller tries Redis again
        assert store._local() is not None  # and the rest stay on the fallback meanwhile
