"""Caller keys for the configured gateway (``tierchain serve``'s stack), over real sockets."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tierchain.config import ConfigError, from_env
from tierchain.keys import CallerKey, CallerKeys
from tierchain.stack import build_stack
from tierchain.telemetry import log_event

from .support import FakeBackend, chat_request, completion_body, serve
from .test_hostile import _check_config

PLAIN = "sk-gw-plain-0123456789abcdef"
OPS = "sk-gw-ops-0123456789abcdef00"
BATCH = "sk-gw-batch-0123456789abcdef"


async def _answer_json(ex: Any) -> None:
    await ex.respond(200, completion_body("ok"))


@contextlib.asynccontextmanager
async def keyed_gateway(
    tmp_path: Path, tower: FakeBackend, hosted: FakeBackend, **env: str
) -> AsyncIterator[str]:
    routes = tmp_path / "routes.toml"
    routes.write_text(
        f'[[routes.echo.backends]]\nname = "tower"\nurl = "{tower.url}"\n'
        f'[[routes.echo.backends]]\nname = "hosted"\nurl = "{hosted.url}"\n'
    )
    keys = tmp_path / "keys.toml"
    keys.write_text(
        '[[keys]]\nname = "ops"\nkey_env = "GW_KEY_OPS"\nprefer = true\n'
        f'[[keys]]\nname = "batch"\nkey = "{BATCH}"\nbackend = "hosted"\n'
    )
    environ = {
        "TIERCHAIN_ROUTES_FILE": str(routes),
        "TIERCHAIN_IDENTITY": "off",
        "TIERCHAIN_API_KEYS": PLAIN,
        "TIERCHAIN_API_KEYS_FILE": str(keys),
        **env,
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GW_KEY_OPS", OPS)
        app = build_stack(None, from_env(environ))
    async with serve(app, lifespan="on") as url:
        yield url


@pytest.fixture
async def backends() -> AsyncIterator[tuple[FakeBackend, FakeBackend]]:
    async with FakeBackend("tower") as tower, FakeBackend("hosted") as hosted:
        tower.script = hosted.script = _answer_json
        yield tower, hosted


async def _post(client: httpx.AsyncClient, url: str, **headers: str) -> httpx.Response:
    return await client.post(
        url + "/v1/chat/completions", content=chat_request("echo", stream=False), headers=headers
    )


async def test_without_a_valid_key_the_routed_paths_answer_401_and_health_stays_open(
    tmp_path: Path, backends: tuple[FakeBackend, FakeBackend]
) -> None:
    tower, hosted = backends
    async with keyed_gateway(tmp_path, tower, hosted) as url, httpx.AsyncClient() as client:
        missing = await _post(client, url)
        unknown = await _post(client, url, authorization="Bearer sk-not-a-key-0123456789")
        health = await client.get(url + "/healthz")
        metrics = await client.get(url + "/metrics")
        models = await client.get(url + "/v1/models")
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "missing_key"
    assert missing.json()["error"]["type"] == "authentication_error"
    assert missing.headers["www-authenticate"] == 'Bearer realm="tierchain"'
    assert unknown.status_code == 401
    assert unknown.json()["error"]["code"] == "unknown_key"
    assert [health.status_code, metrics.status_code, models.status_code] == [200, 200, 200]
    assert 'tierchain_requests_refused_total{reason="missing_key",status="401"}' in metrics.text
    assert not tower.requests
    assert not hosted.requests


async def test_a_valid_key_routes_and_is_never_forwarded(
    tmp_path: Path, backends: tuple[FakeBackend, FakeBackend]
) -> None:
    tower, hosted = backends
    async with keyed_gateway(tmp_path, tower, hosted) as url, httpx.AsyncClient() as client:
        bearer = await _post(client, url, authorization=f"Bearer {PLAIN}")
        anthropic = await _post(client, url, **{"x-api-key": PLAIN})
    assert [bearer.status_code, anthropic.status_code] == [200, 200]
    assert len(tower.requests) == 2
    for seen in tower.requests:
        assert "authorization" not in seen.headers
        assert "x-api-key" not in seen.headers


async def test_only_a_key_allowed_to_steer_reaches_the_paid_tier_by_asking(
    tmp_path: Path, backends: tuple[FakeBackend, FakeBackend]
) -> None:
    tower, hosted = backends
    async with keyed_gateway(tmp_path, tower, hosted) as url, httpx.AsyncClient() as client:
        plain = await _post(
            client, url, authorization=f"Bearer {PLAIN}", **{"x-prefer-backend": "hosted"}
        )
        assert plain.headers["x-tierchain-backend"] == "tower"  # the header was dropped
        ops = await _post(
            client, url, authorization=f"Bearer {OPS}", **{"x-prefer-backend": "hosted"}
        )
        assert ops.headers["x-tierchain-backend"] == "hosted"
        batch = await _post(client, url, authorization=f"Bearer {BATCH}")
        assert batch.headers["x-tierchain-backend"] == "hosted"  # pinned toward hosted
        ops_alone = await _post(client, url, authorization=f"Bearer {OPS}")
        assert ops_alone.headers["x-tierchain-backend"] == "tower"
    assert len(tower.requests) == 2
    assert len(hosted.requests) == 2


def test_keys_are_masked_in_check_config_and_in_log_events(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    routes = tmp_path / "routes.toml"
    routes.write_text('[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:9"\n')
    for args in ((), ("--json",)):
        done = _check_config(*args, TIERCHAIN_ROUTES_FILE=str(routes), TIERCHAIN_API_KEYS=PLAIN)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "CallerKeys" in done.stdout
        assert PLAIN not in done.stdout + done.stderr
    CallerKeys(lambda *a: None, keys=[CallerKey("ops", OPS)])
    with caplog.at_level(logging.INFO, logger="tierchain"):
        log_event("test.quoted", error=f"upstream said: bad key {OPS}")
    assert OPS not in caplog.text
    assert "bad key ***" in caplog.text


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ('[[keys]]\nname = "a"\nkey = "short"\n', "16 to 512"),
        ('[[keys]]\nname = "a"\nkey_env = "GW_UNSET_KEY_VAR"\n', "GW_UNSET_KEY_VAR is not set"),
        ('[[keys]]\nname = "a"\nkey = "sk-gw-0123456789abcdef"\nsteer = true\n', "unknown"),
        ("", "[[keys]] tables"),
    ],
)
def test_a_bad_keys_file_is_a_configuration_error(
    tmp_path: Path, content: str, problem: str
) -> None:
    routes = tmp_path / "routes.toml"
    routes.write_text('[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:9"\n')
    keys = tmp_path / "keys.toml"
    keys.write_text(content)
    settings = from_env(
        {"TIERCHAIN_ROUTES_FILE": str(routes), "TIERCHAIN_API_KEYS_FILE": str(keys)}
    )
    with pytest.raises(ConfigError, match="CallerKeys rejected") as info:
        build_stack(None, settings)
    assert problem in str(info.value)


def test_the_one_pattern_of_every_key_finds_each_key_and_nothing_else():
    import re

    from tierchain.keys import _trie

    keys = [
        b"sk-gw-0123456789abcdef",
        b"sk-gw-0123456789abcdefXYZ",  # another key's prefix
        b"sk-gw-9999999999999999",
        b"a.b*c+d?e(f)g[h]i{j}k|l^m$n\\o",  # every regex metacharacter, as itself
    ]
    find = re.compile(_trie(set(keys))).search
    for key in keys:
        assert find(b"x: " + key + b" y") is not None
    assert find(b"sk-gw-0123456789abcde") is None  # one byte short
    assert find(b"aXb*c+d?e(f)g[h]i{j}k|l^m$n\\o") is None
