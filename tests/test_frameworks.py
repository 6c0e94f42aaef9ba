"""The same classes under FastAPI and Litestar, each on a real uvicorn server."""

from __future__ import annotations

import logging
import re

import httpx
import pytest

from examples.fastapi_app import create_app as fastapi_app
from examples.litestar_app import create_app as litestar_app
from tierchain import Backend, Routes

from .support import (
    FakeBackend,
    answers,
    chat_request,
    on_virtual_time,
    openai_stream,
    refused_url,
    serve,
    streams,
)

FRAMEWORKS = [pytest.param(fastapi_app, id="fastapi"), pytest.param(litestar_app, id="litestar")]


@pytest.mark.parametrize("factory", FRAMEWORKS)
async def test_the_example_gateway_fails_over_to_the_hosted_tier(factory):
    async with FakeBackend("hosted", streams(["hi ", "there"])) as hosted:
        routes = Routes({"echo": [Backend("tower", refused_url()), Backend("hosted", hosted.url)]})
        async with (
            # (the real answer's headers, on a slow machine too: see the test below)
            serve(factory(routes, commit_after=60.0), lifespan="on") as url,
            httpx.AsyncClient(timeout=5) as client,
        ):
            response = await client.post(url + "/v1/chat/completions", content=chat_request())
            health = await client.get(url + "/healthz")
    assert response.status_code == 200
    # Heartbeats (outermost) shows the failover as comment lines before the data.
    heartbeat = re.compile(rb': \{"state":"([a-z_]+)"[^\n]*\n')
    assert heartbeat.findall(response.content) == [
        b"attempt",
        b"backend_failed",
        b"attempt",
        b"generating",
    ]
    assert heartbeat.sub(b"", response.content) == b"".join(openai_stream(["hi ", "there"]))
    assert response.headers["x-tierchain-attempts"] == (
        "tower;outcome=connect_refused, hosted;outcome=ok"
    )
    assert hosted.requests[0].path == "/v1/chat/completions"
    assert health.json() == {"status": "ok"}


@pytest.mark.parametrize("factory", FRAMEWORKS)
async def test_the_example_gateway_passes_a_backend_400_through(factory):
    async def bad(ex):
        await ex.respond(400, b'{"error":{"message":"no"}}')

    async with FakeBackend("tower", bad) as tower, FakeBackend("hosted") as hosted:
        routes = Routes({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]})
        async with (
            serve(factory(routes), lifespan="on") as url,
            httpx.AsyncClient(timeout=5) as client,
        ):
            response = await client.post(url + "/v1/chat/completions", content=chat_request())
    assert response.status_code == 400
    assert hosted.requests == []


@pytest.mark.parametrize("factory", FRAMEWORKS)
@on_virtual_time
async def test_the_whole_stack_routes_around_a_quiet_tower_and_then_skips_it(factory):
    # The seed-000 shape through every layer of the example gateway: the tower
    # accepts and goes quiet; the watchdog gives up on it, the hosted tier
    # answers; after that verdict the tower is suspect, and the callers after skip
    # it without a wait (the breaker would, after two saturations).
    async def quiet(ex):
        await ex.head()
        await ex.write(b": ping\n\n")
        await ex.wait_closed_by_peer()

    async with (
        FakeBackend("tower", quiet) as tower,
        FakeBackend("hosted", streams(["ok"])) as hosted,
    ):
        routes = Routes({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]})
        app = factory(routes, slow_after=0.15, heartbeat_interval=0.05, commit_after=0.05)
        async with (
            serve(app, lifespan="on") as url,
            httpx.AsyncClient(timeout=5) as client,
        ):
            bodies = []
            for _ in range(3):
                r = await client.post(url + "/v1/chat/completions", content=chat_request())
                bodies.append(r.content)
    states = [re.findall(rb'"state":"([a-z_]+)"', body) for body in bodies]
    assert b"backend_saturated" in states[0]
    for seen in states:
        assert seen[-1] == b"generating"
    for seen in states[1:]:
        assert b"backend_busy" in seen  # suspect since the first caller's verdict
        assert b"backend_saturated" not in seen
    assert len(tower.requests) == 1  # the later requests never reached the tower
    assert len(hosted.requests) == 3
    for body in bodies:
        assert body.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("status", [429, 500, 502])
@pytest.mark.parametrize("factory", FRAMEWORKS)
async def test_a_retryable_status_is_its_own_outcome_and_logs_nothing_at_error(
    factory, status, caplog
):
    async with (
        FakeBackend("tower", answers(status)) as tower,
        FakeBackend("hosted", streams(["ok"])) as hosted,
    ):
        routes = Routes({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]})
        caplog.set_level(logging.DEBUG)
        # The trail header is the real answer's: a machine slow enough to pass Heartbeats'
        # commit_after (1 s) would get the gateway's own 200 first, whose header has no trail.
        async with (
            serve(factory(routes, commit_after=60.0), lifespan="on") as url,
            httpx.AsyncClient(timeout=5) as client,
        ):
            response = await client.post(url + "/v1/chat/completions", content=chat_request())
    assert response.status_code == 200
    # A 502 (a proxy's "bad gateway") is tried once more on the same tier first.
    again = f"tower;outcome=http_{status}, " if status in (500, 502) else ""
    assert response.headers["x-tierchain-attempts"] == (
        f"tower;outcome=http_{status}, {again}hosted;outcome=ok"
    )
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


@pytest.mark.parametrize("factory", FRAMEWORKS)
async def test_an_unreachable_tier_fails_over_without_an_error_log(factory, caplog):
    async with FakeBackend("hosted", streams(["ok"])) as hosted:
        routes = Routes({"echo": [Backend("tower", refused_url()), Backend("hosted", hosted.url)]})
        caplog.set_level(logging.DEBUG)
        async with (
            serve(factory(routes), lifespan="on") as url,
            httpx.AsyncClient(timeout=5) as client,
        ):
            response = await client.post(
                url + "/v1/chat/completions", content=chat_request(stream=False)
            )
    assert response.headers["x-tierchain-attempts"].startswith("tower;outcome=connect_refused")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
