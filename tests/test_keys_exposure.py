"""Caller keys that never leak, on every header and every path (``tierchain serve``'s stack)."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

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


KEY_B = "sk-gw-other-team-fedcba9876543210"


def _raw_query(head: bytes) -> bytes:
    target = head.split(b" ", 2)[1]
    return target.partition(b"?")[2]


async def test_no_configured_key_reaches_the_backend_in_any_carrier(tmp_path: Path) -> None:
    """CallerKeys itself removes every configured key: the backend forwards the caller's auth
    (so the Forwarder strips nothing), and it records the raw head and query it received."""
    carriers = {
        "bearer_plus_x_api_key": ([("authorization", f"Bearer {KEY}"), ("x-api-key", KEY_B)], ""),
        "two_authorizations": (
            [("authorization", f"Bearer {KEY}"), ("authorization", f"Bearer {KEY_B}")],
            "",
        ),
        "another_header": ([("authorization", f"Bearer {KEY}"), ("x-goog-api-key", KEY_B)], ""),
        "inside_a_value": ([("x-api-key", KEY), ("cookie", f"session=1; gw={KEY_B}")], ""),
        "basic": (
            [
                ("x-api-key", KEY),
                ("authorization", "Basic " + base64.b64encode(f"u:{KEY_B}".encode()).decode()),
            ],
            "",
        ),
        "query_api_key": ([("authorization", f"Bearer {KEY}")], f"?api_key={KEY_B}&n=1"),
        "query_key_encoded": (
            [("authorization", f"Bearer {KEY}")],
            "?key=" + quote(KEY, safe="") + "&n=1",
        ),
        "query_own_key": ([("authorization", f"Bearer {KEY}")], f"?n=1&key={KEY}"),
    }
    async with FakeBackend("tower") as tower:
        tower.script = _answer_json
        async with (
            gateway(tmp_path, tower, TIERCHAIN_API_KEYS=f"{KEY},{KEY_B}") as url,
            httpx.AsyncClient() as client,
        ):
            for headers, query in carriers.values():
                response = await client.post(
                    url + "/v1/chat/completions" + query,
                    content=chat_request("echo", stream=False),
                    headers=headers,
                )
                assert response.status_code == 200
    assert len(tower.requests) == len(carriers)
    for (name, (_, query)), seen in zip(carriers.items(), tower.requests, strict=True):
        raw = seen.head
        for key in (KEY, KEY_B):
            assert key.encode() not in raw, name
            assert quote(key, safe="").encode() not in raw, name
            assert base64.b64encode(f"u:{key}".encode()) not in raw, name
        if query:  # the caller's other parameters go on
            assert _raw_query(raw) == b"n=1", name
    # A credential that is not a gateway key still goes on (forward_caller_auth).
    assert b"session=1" not in tower.requests[3].head  # the field held a key: dropped whole


async def test_an_open_path_forwards_no_configured_key_either(tmp_path: Path) -> None:
    async with FakeBackend("tower") as tower:
        tower.script = _answer_json
        async with (
            gateway(tmp_path, tower, TIERCHAIN_API_KEYS_OPEN_PATHS="/api/") as url,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(
                url + f"/api/chat?api_key={KEY}",
                content=chat_request("echo"),
                headers=[("authorization", "Bearer not-a-gateway-key"), ("x-api-key", KEY)],
            )
    assert response.status_code == 200
    (seen,) = tower.requests
    assert KEY.encode() not in seen.head
    assert b"authorization: Bearer not-a-gateway-key" in seen.head
