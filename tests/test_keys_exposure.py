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
