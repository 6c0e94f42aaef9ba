"""The same classes under FastAPI and Litestar, each on a real uvicorn server."""

from __future__ import annotations

import re

import httpx
import pytest

from examples.fastapi_app import create_app as fastapi_app
from examples.litestar_app import create_app as litestar_app
from tierchain import Backend, Routes

from .support import FakeBackend, chat_request, openai_stream, refused_url, serve, streams

FRAMEWORKS = [pytest.param(fastapi_app, id="fastapi"), pytest.param(litestar_app, id="litestar")]


@pytest.mark.parametrize("factory", FRAMEWORKS)
async def test_the_example_gateway_fails_over_to_the_hosted_tier(factory):
    async with FakeBackend("hosted", streams(["hi ", "there"])) as hosted:
        routes = Routes({"echo": [Backend("tower", refused_url()), Backend("hosted", hosted.url)]})
        async with (
            serve(factory(routes), lifespan="on") as url,
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
