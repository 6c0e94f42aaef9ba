"""Every tier rate limited: HTTP 429 for every caller, streaming ones included (issue 41, item 9).

Over the layers ``tierchain serve`` builds (``build_stack`` from a routes file, its defaults:
Heartbeats commits a quiet stream after 1 s) on uvicorn, with fake backends on loopback and
the package clock virtual: the tower answers 429 with ``Retry-After: 7``, hosted 429 with
``Retry-After: 30``. A streaming caller used to get its headers committed at 1 s, then an
in-band error at 7.3 s, never the 429 its SDK would retry; the callers after it were told 30.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tierchain.config import from_env
from tierchain.stack import build_stack

from .support import FakeBackend, answers, chat_request, now, on_virtual_time, serve, streams

TOWER_429 = answers(429, b'{"error":{"message":"tower is full"}}', **{"Retry-After": "7"})
HOSTED_429 = answers(429, b'{"error":{"message":"quota exceeded"}}', **{"Retry-After": "30"})


def _stack(tmp_path: Path, tower: str, hosted: str) -> Any:
    routes = tmp_path / "routes.toml"
    routes.write_text(
        f'[[routes.echo.backends]]\nname = "tower"\nurl = "{tower}"\nregime = "local"\n\n'
        f'[[routes.echo.backends]]\nname = "hosted"\nurl = "{hosted}"\nregime = "hosted"\n'
    )
    settings = from_env({"TIERCHAIN_ROUTES_FILE": str(routes), "TIERCHAIN_IDENTITY": "0"})
    return build_stack(None, settings)


@on_virtual_time
async def test_a_streaming_caller_every_tier_refused_gets_http_429_with_the_towers_retry_after(
    tmp_path: Path,
) -> None:
    """The raw client: status 429 and ``Retry-After: 7`` (the soonest announced), though
    the gateway waited out the tower's 7 s once (far past Heartbeats' 1 s commit); the
    next caller, every tier now cooling down, hears 429 with the tower's time too, not 30."""
    async with (
        FakeBackend("tower", TOWER_429) as tower,
        FakeBackend("hosted", HOSTED_429) as hosted,
    ):
        app = _stack(tmp_path, tower.url, hosted.url)
        async with serve(app, lifespan="on") as url, httpx.AsyncClient(timeout=300) as client:
            t0 = now()
            async with client.stream(
                "POST", url + "/v1/chat/completions", content=chat_request(stream=True)
            ) as first:
                body = await first.aread()
            took = now() - t0
            second = await client.post(
                url + "/v1/chat/completions", content=chat_request(stream=True)
            )
    assert first.status_code == 429, body
    assert took >= 7.0  # the tower's Retry-After was waited out once, with nothing sent
    assert first.headers["retry-after"] == "7"
    assert first.headers["content-type"].startswith("application/json")
    assert first.json()["error"]["type"] == "rate_limit_exceeded"
    assert second.status_code == 429
    assert 1 <= int(second.headers["retry-after"]) <= 7, second.headers
    assert len(tower.requests) == 2  # the first try and its one wait; the second caller: none


@on_virtual_time
async def test_the_openai_sdk_streaming_sees_a_rate_limit_error_when_every_tier_said_429(
    tmp_path: Path,
) -> None:
    async with (
        FakeBackend("tower", TOWER_429) as tower,
        FakeBackend("hosted", HOSTED_429) as hosted,
    ):
        app = _stack(tmp_path, tower.url, hosted.url)
        async with (
            serve(app, lifespan="on") as url,
            openai.AsyncOpenAI(base_url=url + "/v1", api_key="test", max_retries=0) as client,
        ):
            with pytest.raises(openai.RateLimitError) as caught:
                stream = await client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": "hi"}], stream=True
                )
                async for _ in stream:
                    pass
    assert caught.value.status_code == 429
    assert caught.value.response.headers["retry-after"] == "7"


@on_virtual_time
async def test_a_tier_that_answers_after_a_429_still_gets_the_usual_commit_and_keepalives(
    tmp_path: Path,
) -> None:
    """Held only while every tier so far refused: hosted, slow to its first token after the
    tower's 429, gets Heartbeats' own commit (and its state lines) as any quiet stream does."""

    async def slow(ex: Any) -> None:
        await asyncio.sleep(20)
        await streams(["from ", "hosted"])(ex)

    async with (
        FakeBackend("tower", answers(429, b'{"error":{"message":"full"}}')) as tower,
        FakeBackend("hosted", slow) as hosted,
    ):
        app = _stack(tmp_path, tower.url, hosted.url)
        async with serve(app, lifespan="on") as url, httpx.AsyncClient(timeout=300) as client:
            t0 = now()
            async with client.stream(
                "POST", url + "/v1/chat/completions", content=chat_request(stream=True)
            ) as response:
                committed = now() - t0
                body = await response.aread()
    assert response.status_code == 200
    assert committed < 5.0  # Heartbeats' own commit, not the hosted answer's at 20 s
    assert b': {"state":"attempt"' in body
    assert b"from " in body
