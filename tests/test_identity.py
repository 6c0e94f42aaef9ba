"""The start-up identity line (seed 003): once, timestamped, secrets masked."""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from litestar import Litestar, get
from litestar.middleware import DefineMiddleware

from tierchain import Backend, Forwarder, Routes, identity
from tierchain.config import from_env
from tierchain.identity import EVENT, Once, StartupIdentity, identity_fields
from tierchain.telemetry import VERSION

from .support import serve

KEY = "sk-live-do-not-log-me"
TOKEN = "admin-token-do-not-log-0123"

ROUTES = Routes(
    {
        "echo": [
            Backend("tower", "http://ops:towerpass@10.0.0.5:11434", regime="local"),
            Backend(
                "hosted",
                "https://api.example.com/v1?api_key=querykey",
                regime="hosted",
                headers={"Authorization": f"Bearer {KEY}"},
            ),
        ]
    }
)


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.INFO, logger="tierchain")

    def started() -> list[logging.LogRecord]:
        return [r for r in caplog.records if getattr(r, "event", None) == EVENT]

    return started


async def hello(scope, receive, send):
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hi"})


async def test_the_line_is_written_once_at_lifespan_startup_before_any_request(lines):
    # A Forwarder answers lifespan (and closes on shut-down); with no route, requests get 404.
    app = StartupIdentity(Forwarder(), routes=ROUTES, once=Once())
    async with LifespanManager(app) as manager:
        assert len(lines()) == 1
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            for _ in range(3):
                assert (await client.get("/")).status_code == 404
    assert len(lines()) == 1


async def test_without_lifespan_the_line_is_written_on_the_first_request_once(lines):
    app = StartupIdentity(hello, routes=ROUTES, once=Once())
    async with serve(app, lifespan="off") as url, httpx.AsyncClient() as client:
        assert lines() == []
        await client.get(url)
        assert len(lines()) == 1
        await client.get(url)
        await client.get(url)
    assert len(lines()) == 1


async def test_under_litestar_per_route_stacks_still_write_one_line(lines):
    @get("/a")
    async def a() -> str:
        return "a"

    @get("/b")
    async def b() -> str:
        return "b"

    once = Once()
    app = Litestar(
        route_handlers=[a, b],
        middleware=[DefineMiddleware(StartupIdentity, routes=ROUTES, once=once)],
        logging_config=None,
    )
    async with serve(app, lifespan="on") as url, httpx.AsyncClient() as client:
        assert lines() == []  # Litestar keeps lifespan away from middleware
        assert (await client.get(url + "/a")).text == "a"
        assert (await client.get(url + "/b")).text == "b"
    assert len(lines()) == 1


async def test_under_fastapi_the_line_comes_with_lifespan(lines):
    app = FastAPI()

    @app.get("/")
    async def root() -> dict[str, str]:
        return {}

    app.add_middleware(StartupIdentity, routes=ROUTES, once=Once())
    async with serve(app, lifespan="on") as url, httpx.AsyncClient() as client:
        assert len(lines()) == 1
        await client.get(url)
    assert len(lines()) == 1


async def test_instances_share_one_process_wide_guard_by_default(lines, monkeypatch):
    monkeypatch.setattr(identity, "PROCESS_ONCE", Once())
    first = StartupIdentity(hello, routes=ROUTES)
    second = StartupIdentity(hello, routes=ROUTES)
    assert first.write() is True
    assert second.write() is False
    assert len(lines()) == 1


def test_the_line_carries_timestamp_implementation_version_pid_routes_and_settings(lines, tmp_path):
    path = tmp_path / "routes.toml"
    path.write_text('[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:1"\n')
    settings = from_env({"TIERCHAIN_ROUTES_FILE": str(path), "TIERCHAIN_SLOW_AFTER": "45"})
    StartupIdentity(hello, settings=settings, once=Once()).write()
    (record,) = lines()
    fields = record.tierchain
    stamp = datetime.fromisoformat(fields["ts"])
    assert stamp.tzinfo is not None
    assert stamp.utcoffset() == UTC.utcoffset(None)
    assert fields["ts"].endswith("Z")
    assert abs((datetime.now(UTC) - stamp).total_seconds()) < 5
    assert fields["implementation"] == "tierchain"
    assert fields["version"] == VERSION
    assert fields["pid"] == os.getpid()
    assert fields["routes"] == {
        "echo": [{"name": "tower", "url": "http://127.0.0.1:1", "may_hedge": True}]
    }
    assert fields["settings"]["stack"][0] == "Heartbeats"
    assert fields["settings"]["options"]["SaturationWatchdog"]["slow_after"] == 45.0
    assert record.getMessage().startswith("tierchain.started ts=")


def test_no_secret_reaches_the_line(lines, tmp_path):
    path = tmp_path / "routes.toml"
    path.write_text(
        '[[routes.echo.backends]]\nname = "hosted"\nurl = "https://u:urlpass@api.example.com"\n'
        'api_key_env = "HOSTED_KEY"\n'
    )
    settings = from_env(
        {
            "TIERCHAIN_ROUTES_FILE": str(path),
            "HOSTED_KEY": KEY,
            "TIERCHAIN_ADMIN_TOKEN": TOKEN,
            "TIERCHAIN_STORE_URL": "redis://:storepass@10.0.0.9:6379/0",
        }
    )
    StartupIdentity(hello, settings=settings, once=Once()).write()
    StartupIdentity(hello, routes=ROUTES, once=Once()).write()
    first, second = lines()
    for record in (first, second):
        text = record.getMessage() + json.dumps(record.tierchain)
        for secret in (KEY, TOKEN, "storepass", "urlpass", "towerpass", "querykey"):
            assert secret not in text
    assert first.tierchain["settings"]["options"]["Admin"]["token"] == "***"
    assert first.tierchain["routes"]["echo"][0]["headers"] == ["Authorization"]
    assert second.tierchain["routes"]["echo"][0]["url"] == "http://***@10.0.0.5:11434"
    assert second.tierchain["routes"]["echo"][1]["url"] == "https://api.example.com/v1?api_key=***"


def test_plain_mapping_settings_have_secret_sounding_keys_masked():
    fields = identity_fields(
        settings={"slow_after": 30, "admin_token": "t0ken", "nested": {"api_key": "k"}},
        extra={"redis": "redis://:pw@h:6379/0"},
    )
    assert fields["settings"] == {
        "slow_after": 30,
        "admin_token": "***",
        "nested": {"api_key": "***"},
    }
    assert fields["redis"] == "redis://***@h:6379/0"


def test_the_line_says_which_backends_may_be_hedged(lines, tmp_path):
    """A declared regime wins over the address: a hosted API on a private address is not
    hedged unless marked, a tower on loopback is, and ``hedge = true`` always is."""
    path = tmp_path / "routes.toml"
    path.write_text(
        '[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:1"\n\n'
        '[[routes.echo.backends]]\nname = "vpc"\nurl = "http://10.0.0.7:8000"\n'
        'regime = "hosted"\n\n'
        '[[routes.echo.backends]]\nname = "paid"\nurl = "http://10.0.0.8:8000"\n'
        'regime = "hosted"\nhedge = true\n'
    )
    settings = from_env({"TIERCHAIN_ROUTES_FILE": str(path)})
    StartupIdentity(hello, settings=settings, once=Once()).write()
    (record,) = lines()
    shown = {e["name"]: e["may_hedge"] for e in record.tierchain["routes"]["echo"]}
    assert shown == {"tower": True, "vpc": False, "paid": True}
