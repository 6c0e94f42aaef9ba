"""Caller keys that never leak, on every header and every path (``tierchain serve``'s stack)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from tierchain.config import from_env
from tierchain.stack import build_stack

from .support import FakeBackend, chat_request, completion_body, serve

KEY = "sk-gw-plain-0123456789abcdef"


async def _answer_json(ex) -> None:
    await ex.respond(200, completion_body("ok"))


@contextlib.asynccontextmanager
async def gateway(tmp_path: Path, tower: FakeBackend, **env: str) -> AsyncIterator[str]:
    routes = tmp_path / "routes.toml"
    routes.write_text(
        f'[[routes.echo.backends]]\nname = "tower"\nurl = "{tower.url}"\n'
        "forward_caller_auth = true\n"
    )
    environ = {
        "TIERCHAIN_ROUTES_FILE": str(routes),
        "TIERCHAIN_IDENTITY": "off",
        "TIERCHAIN_API_KEYS": KEY,
        **env,
    }
    app = build_stack(None, from_env(environ))
    async with serve(app, lifespan="on") as url:
        yield url


async def test_the_key_is_removed_from_every_header_that_carried_it_even_with_forward_caller_auth(
    tmp_path: Path,
) -> None:
    async with FakeBackend("tower") as tower:
        tower.script = _answer_json
        async with gateway(tmp_path, tower) as url, httpx.AsyncClient() as client:
            response = await client.post(
                url + "/v1/chat/completions",
                content=chat_request("echo", stream=False),
                headers=[
                    ("authorization", f"Bearer {KEY}"),
                    ("x-api-key", KEY),
                    ("api-key", KEY),
                    ("x-api-key", "sk-the-callers-own-upstream-key"),
                ],
            )
    assert response.status_code == 200
    (seen,) = tower.requests
    assert KEY.encode() not in seen.head
    # The caller's own credential for the backend (not the gateway's key) still goes on.
    assert b"\r\nx-api-key: sk-the-callers-own-upstream-key\r\n" in seen.head.lower()


async def test_without_a_key_an_ollama_path_gets_401_in_ollamas_own_shape(tmp_path: Path) -> None:
    async with FakeBackend("tower") as tower:
        tower.script = _answer_json
        async with gateway(tmp_path, tower) as url, httpx.AsyncClient() as client:
            ollama = await client.post(url + "/api/chat", content=chat_request("echo"))
            show = await client.post(url + "/api/show", content=b'{"model":"echo"}')
            openai = await client.post(url + "/v1/chat/completions", content=chat_request("echo"))
    assert [ollama.status_code, show.status_code, openai.status_code] == [401, 401, 401]
    assert ollama.json() == {"error": ollama.json()["error"]}
    assert "API key" in ollama.json()["error"]  # a string, as Ollama answers: its apps read it
    assert isinstance(show.json()["error"], str)
    assert openai.json()["error"]["code"] == "missing_key"
    assert tower.requests == []


async def test_keys_can_be_optional_under_a_path_prefix(tmp_path: Path) -> None:
    async with FakeBackend("tower") as tower:
        tower.script = _answer_json
        async with (
            gateway(tmp_path, tower, TIERCHAIN_API_KEYS_OPEN_PATHS="/api/") as url,
            httpx.AsyncClient() as client,
        ):
            open_ = await client.post(url + "/api/chat", content=chat_request("echo"))
            keyed = await client.post(url + "/v1/chat/completions", content=chat_request("echo"))
            sneaky = await client.post(
                url + "/api/%2e%2e/v1/chat/completions", content=chat_request("echo")
            )
            own_credential = await client.post(
                url + "/api/chat",
                content=chat_request("echo"),
                headers={"authorization": "Bearer the-callers-own-ollama-token"},
            )
    assert open_.status_code == 200
    assert keyed.status_code == 401
    assert sneaky.status_code in (400, 401)  # never "open" by a path that leaves /api/
    assert own_credential.status_code == 200
    assert len(tower.requests) == 2
    # Not the gateway's key: a backend with forward_caller_auth gets it as the caller sent it.
    assert tower.requests[1].headers["authorization"] == "Bearer the-callers-own-ollama-token"


def test_the_identity_line_says_keys_off_when_no_key_is_set_and_masks_them_when_set(
    tmp_path: Path,
) -> None:
    routes = tmp_path / "routes.toml"
    routes.write_text('[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:9"\n')
    off = from_env({"TIERCHAIN_ROUTES_FILE": str(routes)})
    on = from_env({"TIERCHAIN_ROUTES_FILE": str(routes), "TIERCHAIN_API_KEYS": KEY})
    assert off.effective()["options"]["CallerKeys"] == {"keys": "off"}
    assert not off.keys_on
    assert on.keys_on
    assert on.effective()["options"]["CallerKeys"]["keys"] == "***"
    assert KEY not in repr(on.effective())


async def test_serve_without_keys_warns_loudly_at_start_up(tmp_path: Path) -> None:
    import signal

    from .test_serve import START_TIMEOUT, tierchain_serve

    routes = tmp_path / "routes.toml"
    routes.write_text('[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:9"\n')
    env = {
        "TIERCHAIN_ROUTES_FILE": str(routes),
        "TIERCHAIN_LOG_FORMAT": "json",
        "TIERCHAIN_PORT": "0",
    }
    async with tierchain_serve(env) as served:
        warning = await served.event("serve.keys_off", within=START_TIMEOUT)
        started = await served.event("tierchain.started", within=START_TIMEOUT)
        served.proc.send_signal(signal.SIGTERM)
        assert await served.exit_status(10.0) == 0
    assert warning["level"] == "WARNING"
    assert "TIERCHAIN_API_KEYS" in warning["warning"]
    assert started["settings"]["options"]["CallerKeys"] == {"keys": "off"}
