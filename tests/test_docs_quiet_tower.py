"""Every documented gateway reaches hosted when the tower is quiet (issue 20).

Each ```python block in README.md and docs/ that builds a whole gateway (a
Failover with a SaturationWatchdog, a tower and a hosted tier) is run as
written, with only the two tiers' URLs pointed at fake backends on loopback:
the tower accepts every request and says nothing. The documented environment
quick start (docs/index.md's ``export`` line with its routes file) and
``tierchain serve``'s own defaults (a routes file, nothing else) are run the
same way. Each must answer from hosted, and leave hosted at least the reserve:
the caller's budget header is short (3 s), so the reserve (half of it at most)
is what ends the tower's attempt whenever the window is longer.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import httpx
import pytest

from tierchain.config import build_stack, from_env

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
from .test_docs_run import BLOCKS, ROOT, Block

TOWER_URL = "http://127.0.0.1:11434"
HOSTED_URL = "https://api.example.com"
HOSTED = b"".join(openai_stream(["from ", "hosted"]))


def whole_gateway(block: Block) -> bool:
    code = block.code
    return (
        not block.fragment
        and "Failover" in code
        and "SaturationWatchdog" in code
        and TOWER_URL in code
        and HOSTED_URL in code
        and "RedisStore(" not in code  # needs a redis server: tests/test_redis_store.py
    )


GATEWAYS = [block for block in BLOCKS if whole_gateway(block)]


async def quiet(ex: Exchange) -> None:
    await ex.wait_closed_by_peer()


async def ask(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(
            url + "/v1/chat/completions",
            content=chat_request(),
            headers={"x-request-timeout": "3"},
        )


def test_the_documented_gateways_are_found():
    # README's, docs/index.md's, the Litestar one and the Budget page's at least.
    found = {block.path.name for block in GATEWAYS}
    assert {"README.md", "index.md", "ordering.md", "budget.md"} <= found


@pytest.mark.parametrize("block", GATEWAYS, ids=[b.id for b in GATEWAYS])
@on_virtual_time
async def test_a_documented_gateway_reaches_hosted_past_a_quiet_tower(block, monkeypatch):
    async with (
        FakeBackend("tower", quiet) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        code = block.code.replace(TOWER_URL, tower.url).replace(HOSTED_URL, hosted.url)
        module = types.ModuleType(f"docs_block_{block.line}")
        monkeypatch.setitem(sys.modules, module.__name__, module)  # Litestar reads its types
        exec(compile(code, block.id, "exec"), module.__dict__)  # the block, as written
        async with serve(module.__dict__["app"], lifespan="auto") as url:
            response = await ask(url)
    assert_hosted_past_the_tower(response)
    assert len(tower.requests) == 1


def assert_hosted_past_the_tower(response: httpx.Response) -> None:
    assert response.status_code == 200
    assert response.content.endswith(HOSTED)
    if "x-tierchain-attempts" in response.headers:  # no Heartbeats: the trail is a header
        trail = response.headers["x-tierchain-attempts"]
        assert trail == "tower;outcome=saturated, hosted;outcome=ok"
    else:  # Heartbeats started the stream: the caller saw the failover as state lines
        states = [
            json.loads(line[2:])
            for line in response.content.decode().splitlines()
            if line.startswith(": {")
        ]
        saturated = [s for s in states if s["state"] == "backend_saturated"]
        # Every documented window is longer than 3 s less the reserve: the reserve ends it.
        assert saturated[0] == {
            "state": "backend_saturated",
            "backend": "tower",
            "reason": "reserve",
            "failing_over": True,
        }
        assert states[-1] == {"state": "generating", "backend": "hosted"}


def _export_line() -> dict[str, str]:
    text = (ROOT / "docs" / "index.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("export TIERCHAIN_ROUTES_FILE="))
    return dict(pair.split("=", 1) for pair in line.removeprefix("export ").split())


def _routes_file(path: Path, tower: str, hosted: str) -> None:
    path.write_text(
        "[[routes.echo.backends]]\n"
        f'name = "tower"\nurl = "{tower}"\nregime = "local"\n\n'
        "[[routes.echo.backends]]\n"
        f'name = "hosted"\nurl = "{hosted}"\nregime = "hosted"\n'
    )


@pytest.mark.parametrize("source", ["docs/index.md export line", "tierchain serve defaults"])
@on_virtual_time
async def test_the_environment_quick_start_reaches_hosted_past_a_quiet_tower(source, tmp_path):
    async with (
        FakeBackend("tower", quiet) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        routes = tmp_path / "routes.toml"
        _routes_file(routes, tower.url, hosted.url)
        env = _export_line() if source.startswith("docs") else {}
        env["TIERCHAIN_ROUTES_FILE"] = str(routes)
        settings = from_env(env)
        app = build_stack(None, settings, identity=False)
        async with serve(app, lifespan="on") as url:
            response = await ask(url)
    assert_hosted_past_the_tower(response)
    if source.startswith("tierchain serve"):
        assert settings.middleware_kwargs("SaturationWatchdog")["slow_after"].maximum == 30.0


# -- issue 32: the documented budget, no header: the prompt rate ends the wait ----------

FIRST_CALLER_BOUND = 15.0  # seconds before anything is learned (issue 32)


async def ask_as_documented(url: str) -> tuple[httpx.Response, float]:
    """One request with no budget header (the documented budget applies), and how long it
    took on the virtual clock."""
    started = now()
    async with httpx.AsyncClient(timeout=600) as client:
        response = await client.post(url + "/v1/chat/completions", content=chat_request())
    return response, now() - started


def assert_too_slow_first(response: httpx.Response) -> None:
    assert response.status_code == 200
    assert response.content.endswith(HOSTED)
    if "x-tierchain-attempts" in response.headers:
        assert response.headers["x-tierchain-attempts"] == (
            "tower;outcome=saturated, hosted;outcome=ok"
        )
    else:
        states = [
            json.loads(line[2:])
            for line in response.content.decode().splitlines()
            if line.startswith(": {")
        ]
        saturated = [s for s in states if s["state"] == "backend_saturated"]
        assert saturated[0]["reason"] == "too_slow"


def assert_hedged_or_too_slow_first(response: httpx.Response) -> None:
    """``tierchain serve`` hedges a quiet local tower after 5 s (issue 32 item 3; see
    docs/hedging.md): hosted answers and the tower lost the race, else (no hedge) it was cut
    as too slow."""
    states = [
        json.loads(line[2:])
        for line in response.content.decode().splitlines()
        if line.startswith(": {")
    ]
    if not any(s["state"] == "hedging" for s in states):
        return assert_too_slow_first(response)
    assert response.status_code == 200
    assert response.content.endswith(HOSTED)
    assert {"state": "hedging", "backend": "tower", "with": "hosted", "after_s": 5.0} in states
    assert [s["state"] for s in states][-1] == "generating"
    assert states[-1]["backend"] == "hosted"
    return None


@pytest.mark.parametrize("block", GATEWAYS, ids=[b.id for b in GATEWAYS])
@on_virtual_time
async def test_a_documented_gateway_reaches_hosted_within_15s_on_its_own_budget(block, monkeypatch):
    async with (
        FakeBackend("tower", quiet) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        code = block.code.replace(TOWER_URL, tower.url).replace(HOSTED_URL, hosted.url)
        module = types.ModuleType(f"docs_block_{block.line}")
        monkeypatch.setitem(sys.modules, module.__name__, module)
        exec(compile(code, block.id, "exec"), module.__dict__)  # the block, as written
        async with serve(module.__dict__["app"], lifespan="auto") as url:
            response, took = await ask_as_documented(url)
    # The documented compositions hedge a quiet local tower after 5 s, as serve does.
    assert_hedged_or_too_slow_first(response)
    assert took < FIRST_CALLER_BOUND
    if block.id.startswith(("README.md", "docs/index.md")):  # the README's stack: hedged
        assert b'"state":"hedging"' in response.content
        assert took < 6.0


@pytest.mark.parametrize("source", ["docs/index.md export line", "tierchain serve defaults"])
@on_virtual_time
async def test_the_environment_quick_start_reaches_hosted_within_15s_on_its_own_budget(
    source, tmp_path
):
    async with (
        FakeBackend("tower", quiet) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        routes = tmp_path / "routes.toml"
        _routes_file(routes, tower.url, hosted.url)
        env = _export_line() if source.startswith("docs") else {}
        env["TIERCHAIN_ROUTES_FILE"] = str(routes)
        settings = from_env(env)
        app = build_stack(None, settings, identity=False)
        async with serve(app, lifespan="on") as url:
            response, took = await ask_as_documented(url)
    assert_hedged_or_too_slow_first(response)
    assert took < FIRST_CALLER_BOUND
