"""A rested tower is found by the gateway, not by a caller (issue 41, item 8).

A breaker opened for saturation stays open 15 minutes; a backend without a status URL used to
be found rested only when that ran out (69 callers over 75 s went to hosted while the tower sat
idle). The Breaker now checks such a backend itself: a one-token completion of its own every
5 s, and a check answered within 2 s half-opens the breaker, so the next caller is its probe.

Each gateway here is a documented configuration, on uvicorn, with fake backends on loopback
and the package clock virtual: ``tierchain serve``'s defaults (``build_stack`` from a routes
file) and the README's FastAPI composition. The fake tower is starved (it accepts a request
and sends nothing) until ``freed_at``, then answers at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from tierchain import (
    Backend,
    Breaker,
    Budget,
    Failover,
    Forwarder,
    Heartbeats,
    MemoryStore,
    PreferBackend,
    Routes,
    SaturationWatchdog,
)
from tierchain.config import from_env
from tierchain.rested import TASK_NAME, check_request
from tierchain.stack import build_stack
from tierchain.status import StatusBoard

from .support import (
    Exchange,
    FakeBackend,
    chat_request,
    now,
    on_virtual_time,
    parse_sse,
    redis_on_virtual_time,
    serve,
)
from .support import streams as streaming


class Tower:
    """A tower starved until ``freed_at`` (virtual seconds), then quick; counts the
    gateway's own checks (a one-token completion) apart from callers' requests."""

    def __init__(self) -> None:
        self.freed_at = float("inf")
        self.checks: list[float] = []
        self.callers: list[float] = []

    async def __call__(self, ex: Exchange) -> None:
        if ex.request.path.endswith("/slots"):  # llama.cpp's: one slot, busy while starved
            busy = now() < self.freed_at
            slots = [{"id": 0, "is_processing": busy, "n_ctx": 4096}]
            return await ex.respond(200, json.dumps(slots).encode())
        body = json.loads(ex.request.body or b"{}")
        (self.checks if body.get("max_tokens") == 1 else self.callers).append(now())
        wait = self.freed_at - now()
        if wait > 0:
            await asyncio.sleep(wait)  # starved: nothing at all until it is freed
        await streaming(["from ", "tower"])(ex)


def _who(response: httpx.Response) -> str:
    data = "".join(e["data"] or "" for e in parse_sse(response.content))
    return "tower" if "tower" in data else "hosted" if "hosted" in data else ""


def _serve_stack(
    tmp_path: Path, tower: str, hosted: str, store: Any = None, slots: bool = False
) -> Any:
    status = f'status_url = "{tower}/slots"\n' if slots else ""
    routes = tmp_path / "routes.toml"
    routes.write_text(
        f'[[routes.echo.backends]]\nname = "tower"\nurl = "{tower}"\nregime = "local"\n'
        f"{status}\n"
        f'[[routes.echo.backends]]\nname = "hosted"\nurl = "{hosted}"\nregime = "hosted"\n'
    )
    settings = from_env({"TIERCHAIN_ROUTES_FILE": str(routes), "TIERCHAIN_IDENTITY": "0"})
    return build_stack(None, settings, store=store)


def _readme_stack(tower: str, hosted: str, store: MemoryStore, slots: bool = False) -> Any:
    """The README's composition, as written there (its two URLs pointed at the fakes)."""
    status = f"{tower}/slots" if slots else None
    routes = Routes(
        {
            "echo": [
                Backend(name="tower", url=tower, regime="local", status_url=status),
                Backend(name="hosted", url=hosted, regime="hosted"),
            ]
        }
    )
    forwarder = Forwarder(connect_timeout=2.0)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await forwarder.aclose()

    app = FastAPI(lifespan=lifespan)
    app.mount("/v1", forwarder)
    board = StatusBoard(timeout=0.2)
    app.add_middleware(SaturationWatchdog, slow_after=45.0, status_board=board)
    app.add_middleware(Breaker, store=store, status_board=board)
    app.add_middleware(
        Failover, routes=routes, paths=("/v1/",), status_board=board, hedge_after=5.0
    )
    app.add_middleware(PreferBackend, store=store)
    app.add_middleware(Budget, default=170.0)
    app.add_middleware(Heartbeats, interval=10.0)
    return app


async def _open(client: httpx.AsyncClient, url: str, store: Any, tower: Tower) -> float:
    """Callers (a second apart) until the tower's breaker is open for saturation (or, with a
    status URL, until the tower was skipped as busy twice); returns when."""
    skipped = 0
    for _ in range(20):
        reached = len(tower.callers)
        _, _, who = await _ask(client, url)
        assert who == "hosted"
        snap = await store.breaker_snapshot("echo", "tower")
        if snap.state == "open" and snap.reason == "saturation":
            return now()
        skipped += len(tower.callers) == reached
        if skipped >= 2 and snap.state == "closed" and snap.saturations == 0:
            return now()  # skipped as busy before sending: its status says so
        await asyncio.sleep(1.0)
    raise AssertionError("the breaker did not open")


async def _ask(client: httpx.AsyncClient, url: str) -> tuple[float, float, str]:
    """One caller: (when it was sent, how long it took, who answered)."""
    at = now()
    response = await client.post(url + "/v1/chat/completions", content=chat_request())
    return at, now() - at, _who(response)


@pytest.mark.parametrize("config", ["serve", "readme", "serve+slots", "readme+slots"])
@on_virtual_time
async def test_a_tower_freed_after_its_breaker_opened_serves_again_within_15s_no_caller_paying(
    config: str, tmp_path: Path
) -> None:
    tower = Tower()
    store = MemoryStore()
    async with (
        FakeBackend("tower", tower) as tower_fake,
        FakeBackend("hosted", streaming(["from ", "hosted"])) as hosted,
    ):
        slots = config.endswith("+slots")
        if config.startswith("serve"):
            app = _serve_stack(tmp_path, tower_fake.url, hosted.url, store=store, slots=slots)
        else:
            app = _readme_stack(tower_fake.url, hosted.url, store, slots=slots)
        async with serve(app, lifespan="on") as url, httpx.AsyncClient(timeout=300) as client:
            opened = await _open(client, url, store, tower)
            tower.freed_at = now() + 20.0  # the game ends 20 s later
            answered = []
            for _ in range(25):  # a caller every 2 s, for 50 s
                answered.append(await _ask(client, url))
                await asyncio.sleep(max(0.0, answered[-1][0] + 2.0 - now()))
            tasks = [t for t in asyncio.all_tasks() if t.get_name() == TASK_NAME]
        assert not tasks  # the checks ended with the breaker's saturation (and the gateway)
    back = [at for at, _, who in answered if who == "tower"]
    assert back, answered
    assert back[0] - tower.freed_at <= 15.0, (tower.freed_at, answered)
    assert all(who == "tower" for at, _, who in answered if at >= back[0]), answered
    # Nobody paid for a check: before the tower was back, every caller skipped it for hosted
    # (no caller's request reached the tower between the open and its return).
    assert all(who == "hosted" for at, _, who in answered if at < back[0]), answered
    assert not [c for c in tower.callers if opened <= c < back[0]], tower.callers
    if not slots:  # (with a status URL, its status tells: the tower is skipped as busy)
        assert tower.checks  # the gateway's own requests found it
    assert all(c < back[0] for c in tower.checks)  # and stopped once it was back


@contextlib.asynccontextmanager
async def _store(kind: str, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    if kind == "memory":
        yield MemoryStore()
        return
    async with redis_on_virtual_time(request.getfixturevalue("redis_server")) as store:
        yield store


@pytest.mark.parametrize("kind", ["memory", "redis"])
@on_virtual_time
async def test_replicas_sharing_a_store_send_one_check_per_round_between_them(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Two gateways on one store: while the tower stays starved, the checks it receives are
    those of one gateway (one every 5 s), not one from each."""
    tower = Tower()
    async with (
        _store(kind, request) as store,
        FakeBackend("tower", tower) as tower_fake,
        FakeBackend("hosted", streaming(["from ", "hosted"])) as hosted,
    ):
        one = _serve_stack(tmp_path, tower_fake.url, hosted.url, store=store)
        two = _serve_stack(tmp_path, tower_fake.url, hosted.url, store=store)
        async with (
            serve(one, lifespan="on") as url_one,
            serve(two, lifespan="on") as url_two,
            httpx.AsyncClient(timeout=300) as client,
        ):
            await _open(client, url_one, store, tower)
            reached = len(tower.callers)
            _, _, who = await _ask(client, url_two)  # the second sees it open
            assert who == "hosted"
            assert len(tower.callers) == reached  # skipped: it starts checking too
            started = now()
            await asyncio.sleep(60.0)  # starved all along
            checks = [c for c in tower.checks if c >= started]
    assert 6 <= len(checks) <= 14, checks  # about 12 in 60 s: one per 5 s, not two
    assert all(b - a >= 4.0 for a, b in itertools.pairwise(checks)), checks


def test_the_check_speaks_the_backends_wire_format() -> None:
    chat = check_request(Backend("t", "http://127.0.0.1:8080", headers={"X-Key": "k"}), "m", None)
    assert chat[0] == "http://127.0.0.1:8080/v1/chat/completions"
    assert json.loads(chat[1]) == {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "stream": True,
    }
    assert chat[2]["x-key"] == "k"
    ollama = check_request(Backend("o", "http://127.0.0.1:11434", model="qwen"), "m", "ollama")
    assert ollama[0] == "http://127.0.0.1:11434/api/generate"
    assert json.loads(ollama[1])["options"] == {"num_predict": 1}
    assert json.loads(ollama[1])["model"] == "qwen"
    claude = check_request(Backend("a", "http://10.0.0.2", wire_format="anthropic"), "m", None)
    assert claude[0] == "http://10.0.0.2/v1/messages"
    assert claude[2]["anthropic-version"] == "2023-06-01"
