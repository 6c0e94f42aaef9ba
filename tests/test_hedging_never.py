"""The attempts docs/hedging.md says are never hedged, each on its own: one whose next tier is
a pool, a second try of the same backend, and one whose next tier is on the same hardware.

Each scenario would be hedged but for its one rule: a local tower (loopback) that stays quiet
past ``hedge_after`` (5 s) and answers at 8 s, in front of a next tier that would answer at
once. So a hedge, had one started, would show as a request at the next tier and a ``hedging``
state line. Over real sockets (uvicorn, fake upstreams speaking OpenAI chat as in
tests/support.py), on virtual time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx

from tierchain import Backend, Failover, Forwarder, Pool, Routes

from .support import (
    Exchange,
    FakeBackend,
    Recorder,
    Script,
    chat_request,
    now,
    on_virtual_time,
    openai_stream,
    serve,
)

TOWER = openai_stream(["from ", "tower"], model="tower-model")


def quiet_for(seconds: float) -> Script:
    """Accepts, pings, and sends its stream only ``seconds`` (virtual) in."""

    async def script(ex: Exchange) -> None:
        await ex.head()
        await ex.write(b": ping\n\n")
        await asyncio.sleep(seconds)
        for event in TOWER:
            await ex.write(event)
        await ex.end()

    return script


async def boom(ex: Exchange) -> None:
    await ex.respond(500, b'{"error":{"message":"boom"}}')


def in_turn(*scripts: Script) -> Script:
    """The n-th request gets the n-th script."""
    turns: Iterator[Script] = iter(scripts)

    async def script(ex: Exchange) -> None:
        await next(turns)(ex)

    return script


async def through(chain: list[Any]) -> tuple[httpx.Response, Recorder, float]:
    """One streamed chat request through Failover(hedge_after=5) over ``chain``."""
    forwarder = Forwarder()
    recorder = Recorder(Failover(forwarder, routes=Routes({"echo": chain}), hedge_after=5.0))
    try:
        async with serve(recorder) as url, httpx.AsyncClient(timeout=60) as client:
            t0 = now()
            got = await client.post(url + "/v1/chat/completions", content=chat_request())
            took = now() - t0
    finally:
        await forwarder.aclose()
    return got, recorder, took


def hedged(recorder: Recorder) -> list[dict[str, Any]]:
    return [e for e in recorder.events if e["state"] == "hedging"]


@on_virtual_time
async def test_an_attempt_whose_next_tier_is_a_pool_is_never_hedged() -> None:
    async with (
        FakeBackend("tower", quiet_for(8.0)) as tower,
        FakeBackend("a", quiet_for(0.0)) as a,
        FakeBackend("b", quiet_for(0.0)) as b,
    ):
        pool = Pool(name="gpus", backends=[Backend("a", a.url), Backend("b", b.url)])
        got, recorder, took = await through([Backend("tower", tower.url), pool])
    assert got.status_code == 200
    assert got.headers["x-tierchain-backend"] == "tower"
    assert got.content == b": ping\n\n" + b"".join(TOWER)
    assert took == 8.0  # the tower's own answer, waited for
    assert a.requests == b.requests == []
    assert hedged(recorder) == []


@on_virtual_time
async def test_a_second_try_of_the_same_backend_is_never_hedged() -> None:
    async with (
        FakeBackend("tower", in_turn(boom, quiet_for(8.0))) as tower,
        FakeBackend("hosted", quiet_for(0.0)) as hosted,
    ):
        got, recorder, took = await through(
            [Backend("tower", tower.url), Backend("hosted", hosted.url, hedge=True)]
        )
    assert got.status_code == 200
    assert got.headers["x-tierchain-backend"] == "tower"
    assert got.content == b": ping\n\n" + b"".join(TOWER)
    assert len(tower.requests) == 2  # the 500, then the second try that answered at 8 s
    assert 8.0 <= took < 8.25  # and its pause before it, up to 0.25 s at random
    assert hosted.requests == []
    assert hedged(recorder) == []


@on_virtual_time
async def test_an_attempt_whose_next_tier_is_on_the_same_hardware_is_never_hedged() -> None:
    async with (
        FakeBackend("big", quiet_for(8.0)) as big,
        FakeBackend("small", quiet_for(0.0)) as small,
    ):
        got, recorder, took = await through(
            [Backend("big", big.url, shares="gpu0"), Backend("small", small.url, shares="gpu0")]
        )
    assert got.status_code == 200
    assert got.headers["x-tierchain-backend"] == "big"
    assert got.content == b": ping\n\n" + b"".join(TOWER)
    assert took == 8.0
    assert small.requests == []
    assert hedged(recorder) == []


@on_virtual_time
async def test_the_same_chain_on_other_hardware_is_hedged_at_hedge_after() -> None:
    """The control for the three above: without the rule, the quiet tower is hedged."""
    async with (
        FakeBackend("big", quiet_for(8.0)) as big,
        FakeBackend("small", quiet_for(0.0)) as small,
    ):
        got, recorder, took = await through(
            [Backend("big", big.url, shares="gpu0"), Backend("small", small.url, shares="gpu1")]
        )
    assert got.status_code == 200
    assert got.headers["x-tierchain-backend"] == "small"
    assert took == 5.0  # hedge_after; small answers at once
    assert len(small.requests) == 1
    assert hedged(recorder) == [
        {"state": "hedging", "backend": "big", "with": "small", "after_s": 5.0}
    ]


@on_virtual_time
async def test_a_continuation_is_never_hedged() -> None:
    """A broken stream finished on the next tier (docs/continuation.md) is not hedged by the
    tier after it, however long the finishing tier is quiet."""
    from .test_continuation import finisher, tower

    finish = finisher("chat")

    async def quiet_then_finish(ex: Exchange) -> None:
        if ex.request.method == "POST":
            await asyncio.sleep(8.0)
        await finish(ex)  # (it answers the gateway's GET of what server it is with a 404)

    async with (
        FakeBackend("tower", tower("chat")) as first,
        FakeBackend("mid", quiet_then_finish) as mid,
        FakeBackend("hosted", quiet_for(0.0)) as hosted,
    ):
        got, recorder, _ = await through(
            [
                Backend("tower", first.url),
                Backend("mid", mid.url),
                Backend("hosted", hosted.url, hedge=True),
            ]
        )
    assert got.status_code == 200
    assert got.content.endswith(b"data: [DONE]\n\n")
    assert [r.method for r in mid.requests].count("POST") == 1  # the continuation
    assert hosted.requests == []
    assert hedged(recorder) == []
    assert [e for e in recorder.events if e["state"] == "continuing"]
