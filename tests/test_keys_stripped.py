"""CallerKeys itself removes the gateway key from every credential header (docs/keys.md, "Keys
stay secret"), seen at the layer that does it: the app behind CallerKeys gets the scope, so
the Forwarder's own header rules cannot hide a key CallerKeys let through.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tierchain.keys import CALLER_KEY, CallerKey, CallerKeys

KEY = "sk-gw-plain-0123456789abcdef"


class Seen:
    """The app behind CallerKeys: keeps the headers it was given and answers 200."""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.key: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.headers = list(scope["headers"])
        self.key = scope[CALLER_KEY]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


@pytest.mark.parametrize(
    "carriers",
    [
        [("authorization", f"Bearer {KEY}")],
        [("x-api-key", KEY)],
        [("api-key", KEY)],
        [("authorization", f"Bearer {KEY}"), ("x-api-key", KEY), ("api-key", KEY)],
        [("x-api-key", KEY), ("x-api-key", KEY)],  # each one, not only the first
    ],
)
async def test_the_layer_behind_caller_keys_never_sees_the_gateway_key(carriers):
    seen = Seen()
    app = CallerKeys(seen, keys=[CallerKey("plain", KEY)])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        answer = await client.post(
            "/v1/chat/completions",
            content=b"{}",
            headers=[*carriers, ("x-api-key", "sk-the-callers-own-upstream-key")],
        )
    assert answer.status_code == 200
    assert seen.key.name == "plain"
    assert all(KEY.encode() not in value for _, value in seen.headers), seen.headers
    # The caller's own credential for a backend (not the gateway's key) goes on.
    assert (b"x-api-key", b"sk-the-callers-own-upstream-key") in seen.headers
