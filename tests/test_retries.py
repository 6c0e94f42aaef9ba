"""Retry what is worth retrying (issue 31, item 4), over real sockets on virtual time.

The whole stack (Heartbeats -> Budget -> PreferBackend -> Failover -> Breaker ->
SaturationWatchdog -> Forwarder) in front of fake backends on loopback that answer
as real servers do: a 500 once, a 429 with ``Retry-After`` (OpenAI's and
Anthropic's rate limits send one), a 400. Time is the package clock, virtual.
"""

from __future__ import annotations

from typing import Any

import httpx

from tierchain import Backend
from tierchain.config import routes_from_toml

from .support import (
    FakeBackend,
    answers,
    now,
    on_virtual_time,
    once_then,
    serve,
)
from .test_pools import Gateway, post, trail

RATE_LIMITED = (
    b'{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}'
)


@on_virtual_time
async def test_a_500_once_is_answered_by_the_same_tier_after_a_short_pause() -> None:
    async with FakeBackend("local") as local, FakeBackend("hosted") as hosted:
        local.script = once_then(answers(500))
        gw = Gateway(
            [Backend(name="local", url=local.url), Backend(name="hosted", url=hosted.url)],
            threshold=5,
        )
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            r = await post(client, url)
        await gw.aclose()
    assert r.status_code == 200
    assert trail(r) == ["local;outcome=http_500", "local;outcome=ok"]
    assert hosted.requests == []
    (retrying,) = gw.states("retrying")
    assert retrying["backend"] == "local"
    assert retrying["reason"] == "http_500"
    assert 0 <= retrying["after_s"] <= 0.3  # the jitter, no more


@on_virtual_time
async def test_a_429_with_retry_after_2_is_waited_out_and_answered_by_the_same_tier(
    metric: Any,
) -> None:
    async with FakeBackend("local") as local, FakeBackend("hosted") as hosted:
        local.script = once_then(answers(429, RATE_LIMITED, **{"retry-after": "2"}))
        gw = Gateway(
            [Backend(name="local", url=local.url), Backend(name="hosted", url=hosted.url)],
            threshold=5,
        )
        before = metric(
            "tierchain_same_tier_retries_total", route="echo", backend="local", reason="http_429"
        )
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=30) as client:
            started = now()
            r = await post(client, url)
            took = now() - started
        await gw.aclose()
    assert r.status_code == 200
    # Heartbeats committed the stream while the gateway waited (commit_after), so the
    # caller heard the wait as it happened, and the answer came after it.
    assert '{"state":"retrying","backend":"local"' in r.text
    assert "again" in r.text
    records = [(a.backend, a.outcome) for a in gw.requests[-1].attempts]
    assert records == [("local", "http_429"), ("local", "ok")]
    assert hosted.requests == []
    assert len(local.requests) == 2
    assert took >= 1.8
    (retrying,) = gw.states("retrying")
    assert retrying["backend"] == "local"
    assert retrying["reason"] == "http_429"
    assert retrying["after_s"] >= 2.0
    assert [a.get("retry") for a in gw.states("attempt")] == [None, 1]
    after = metric(
        "tierchain_same_tier_retries_total", route="echo", backend="local", reason="http_429"
    )
    assert after - before == 1


@on_virtual_time
async def test_a_retry_after_longer_than_the_budgets_room_fails_over_at_once() -> None:
    async with FakeBackend("local") as local, FakeBackend("hosted") as hosted:
        local.script = answers(429, RATE_LIMITED, **{"retry-after": "8"})
        gw = Gateway(
            [Backend(name="local", url=local.url), Backend(name="hosted", url=hosted.url)],
            budget=10.0,  # the reserve (5 s) leaves 5 s: not 8
            threshold=5,
        )
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=30) as client:
            started = now()
            r = await post(client, url)
            took = now() - started
        await gw.aclose()
    assert r.status_code == 200
    assert trail(r) == ["local;outcome=http_429", "hosted;outcome=ok"]
    assert gw.states("retrying") == []
    assert took < 1.0


@on_virtual_time
async def test_a_400_is_never_tried_again() -> None:
    async with FakeBackend("local") as local, FakeBackend("hosted") as hosted:
        local.script = answers(400, b'{"error":{"message":"bad temperature"}}')
        gw = Gateway(
            [Backend(name="local", url=local.url), Backend(name="hosted", url=hosted.url)],
            threshold=5,
        )
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            r = await post(client, url)
        await gw.aclose()
    assert r.status_code == 400
    assert len(local.requests) == 1
    assert hosted.requests == []


@on_virtual_time
async def test_a_backends_own_retries_0_turns_the_second_try_off() -> None:
    async with FakeBackend("local") as local, FakeBackend("hosted") as hosted:
        local.script = once_then(answers(500))
        gw = Gateway(
            [
                Backend(name="local", url=local.url, retries=0),
                Backend(name="hosted", url=hosted.url),
            ],
            threshold=5,
        )
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            r = await post(client, url)
        await gw.aclose()
    assert trail(r) == ["local;outcome=http_500", "hosted;outcome=ok"]


def test_retries_is_a_routes_file_key() -> None:
    routes = routes_from_toml(
        {
            "routes": {
                "echo": {"backends": [{"name": "local", "url": "http://127.0.0.1:9", "retries": 0}]}
            }
        }
    )
    assert routes["echo"][0].retries == 0


@on_virtual_time
async def test_every_tier_rate_limited_stays_429_for_the_next_caller_while_they_cool_down() -> None:
    """The first caller gets 429 when every tier said 429; the next caller, arriving while
    their breakers cool down from that Retry-After, gets 429 too (it got 503 "cooling down")
    with the soonest Retry-After."""
    async with FakeBackend("local") as local, FakeBackend("hosted") as hosted:
        local.script = answers(429, RATE_LIMITED, **{"retry-after": "30"})
        hosted.script = answers(429, RATE_LIMITED, **{"retry-after": "20"})
        gw = Gateway(
            [Backend(name="local", url=local.url), Backend(name="hosted", url=hosted.url)],
            threshold=5,
        )
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            first = await post(client, url)
            second = await post(client, url)
        await gw.aclose()
    assert first.status_code == 429
    assert second.status_code == 429
    assert trail(second) == ["local;outcome=skipped", "hosted;outcome=skipped"]
    assert 19 <= int(second.headers["retry-after"]) <= 20
    assert second.json()["error"]["type"] == "rate_limit_exceeded"
    assert (len(local.requests), len(hosted.requests)) == (1, 1)
