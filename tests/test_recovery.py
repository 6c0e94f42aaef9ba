"""The breaker spares the next caller sooner and finds a recovered primary (issue 31, item 3).

Over the real layers as ``tierchain serve`` builds them (``build_stack`` with its
defaults) on uvicorn, with fake backends on loopback and the package clock virtual:
the fake primary switches state on that clock, so "down for 60 s" is exact however
busy the machine is. Each case runs with a MemoryStore and with a RedisStore (on a
throwaway redis-server, on the same virtual clock).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tierchain.config import from_env
from tierchain.stack import build_stack

from .support import (
    Exchange,
    FakeBackend,
    chat_request,
    fault,
    now,
    on_virtual_time,
    parse_sse,
    redis_on_virtual_time,
    serve,
    streams,
)


def _routes(tmp_path: Path, primary: str, hosted: str) -> Path:
    routes = tmp_path / "routes.toml"
    routes.write_text(
        f'[[routes.echo.backends]]\nname = "primary"\nurl = "{primary}"\n\n'
        f'[[routes.echo.backends]]\nname = "hosted"\nurl = "{hosted}"\n'
    )
    return routes


def _answered_by(response: httpx.Response) -> str:
    """Whose words the data events carry (state lines name every backend tried: not those)."""
    data = "".join(e["data"] or "" for e in parse_sse(response.content))
    if "[DONE]" not in data:
        return ""  # not a whole answer
    return "primary" if "primary" in data else "hosted" if "hosted" in data else ""


@contextlib.asynccontextmanager
async def _store(kind: str, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    if kind == "memory":
        yield None  # build_stack makes the default MemoryStore (on the package clock)
        return
    # Redis's own TIME is wall-clock: the store reads the package's (virtual) clock instead.
    async with redis_on_virtual_time(request.getfixturevalue("redis_server")) as store:
        yield store


async def _flapping(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest, down: float, n: int, every: float
) -> tuple[list[tuple[float, int, str]], int]:
    """``n`` requests ``every`` seconds apart to a primary that answers 500 for its first
    ``down`` seconds, then streams, with ``tierchain serve``'s defaults: (when each was
    sent, its status, who answered it) and how many requests reached the primary."""
    started = now()
    recovers_at = started + down

    async def primary_script(ex: Exchange) -> None:
        if now() < recovers_at:
            await ex.respond(500, b'{"error":{"message":"CUDA error: device lost"}}')
        else:
            await streams(["from ", "primary"])(ex)

    async with (
        _store(kind, request) as store,
        FakeBackend("primary", primary_script) as primary,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        settings = from_env(
            {
                "TIERCHAIN_ROUTES_FILE": str(_routes(tmp_path, primary.url, hosted.url)),
                "TIERCHAIN_IDENTITY": "0",
            }
        )
        app = build_stack(None, settings, store=store)
        answered: list[tuple[float, int, str]] = []
        async with serve(app, lifespan="on") as url, httpx.AsyncClient(timeout=300) as client:
            for i in range(n):
                await asyncio.sleep(max(0.0, started + every * i - now()))
                at = now()
                r = await client.post(url + "/v1/chat/completions", content=chat_request())
                answered.append((at - started, r.status_code, _answered_by(r)))
    return answered, len(primary.requests)


@pytest.mark.parametrize("kind", ["memory", "redis"])
@on_virtual_time
async def test_a_primary_down_6s_serves_again_before_the_tenth_request_1_2s_apart(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The failover benchmark's fast flapping case: down 6 s, ten requests 1.2 s apart. The
    breaker opens at the fifth (one failure per request, its same-tier retry included) and
    probes 2 s later, so the primary answers again before the tenth (it used to be never:
    the first probe came 10 s after the open)."""
    answered, _ = await _flapping(kind, tmp_path, request, down=6.0, n=10, every=1.2)
    assert all(status == 200 and who for _, status, who in answered), answered
    back = [i for i, (_, _, who) in enumerate(answered) if who == "primary"]
    assert back, answered
    assert back[0] < 9, answered
    assert all(who == "primary" for _, _, who in answered[back[0] :]), answered


@pytest.mark.parametrize("kind", ["memory", "redis"])
@on_virtual_time
async def test_a_primary_down_60s_then_healthy_is_used_again_4s_after_recovering(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The benchmark's full case: 20 requests 4 s apart; the primary answers 500 for its
    first 60 s, then streams. Every request is answered, and the primary answers again 4 s
    after it recovered, the first request after (docs/breaker.md: its probes came 2, 4, 6 ...
    s apart while it was down, so one is due by then)."""
    answered, reached = await _flapping(kind, tmp_path, request, down=60.0, n=20, every=4.0)
    assert all(status == 200 and who for _, status, who in answered), answered
    back = [at for at, _, who in answered if who == "primary" and at >= 60.0]
    assert back, answered
    assert back[0] == pytest.approx(64.0), answered
    assert all(who == "hosted" for at, _, who in answered if at < 60.0)
    # The breaker spared most callers while it was down: a few probes, not two tries each.
    assert reached < 20


@pytest.mark.parametrize("kind", ["memory", "redis"])
@on_virtual_time
async def test_a_mid_stream_death_spares_the_next_callers(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A primary that dies mid-answer (a lost turn for its caller) is skipped by the callers
    after, with `tierchain serve`'s defaults: the death marks it suspect in the store (and
    two in a row open its breaker); it took five deaths before."""
    async with (
        _store(kind, request) as store,
        FakeBackend("primary", fault("reset", after=2)) as primary,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        settings = from_env(
            {
                "TIERCHAIN_ROUTES_FILE": str(_routes(tmp_path, primary.url, hosted.url)),
                "TIERCHAIN_IDENTITY": "0",
            }
        )
        app = build_stack(None, settings, store=store)
        async with serve(app, lifespan="on") as url, httpx.AsyncClient(timeout=300) as client:
            await client.post(url + "/v1/chat/completions", content=chat_request())
            later = [
                await client.post(url + "/v1/chat/completions", content=chat_request())
                for _ in range(2)
            ]
    assert len(primary.requests) == 1
    assert [_answered_by(r) for r in later] == ["hosted", "hosted"]
