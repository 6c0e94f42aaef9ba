"""The audit's smaller findings (issue 33), each fixed at its root."""

from __future__ import annotations

from typing import Any

import httpx

from tierchain import Backend, Failover, Forwarder, Routes

from .support import FakeBackend, chat_request, completion_body, on_virtual_time, serve


@on_virtual_time
async def test_an_upstreams_x_tierchain_headers_never_reach_the_caller() -> None:
    async def spoofing(ex: Any) -> None:
        await ex.respond(
            200,
            completion_body("ok"),
            {"x-tierchain-backend": "hosted", "x-tierchain-attempts": "forged", "x-other": "kept"},
        )

    async def host_handler(scope: Any, receive: Any, send: Any) -> None:
        # A host's own handler that passes the upstream's headers on as they came.
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"x-tierchain-backend", b"forged"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": completion_body("ok")})

    async with FakeBackend("tower", spoofing) as tower:
        forwarder = Forwarder()
        lone = Forwarder(backend=Backend("tower", tower.url))
        routes = Routes({"echo": [Backend("tower", tower.url)]})
        async with (
            serve(Failover(forwarder, routes=routes)) as url,
            serve(Failover(host_handler, routes=routes)) as host,
            serve(lone) as alone,
            httpx.AsyncClient() as client,
        ):
            body = chat_request(stream=False)
            via = await client.post(url + "/v1/chat/completions", content=body)
            handled = await client.post(host + "/v1/chat/completions", content=body)
            bare = await client.post(alone + "/v1/chat/completions", content=body)
        await forwarder.aclose()
        await lone.aclose()
    assert via.headers.get_list("x-tierchain-backend") == ["tower"]
    assert via.headers.get_list("x-tierchain-attempts") == ["tower;outcome=ok"]
    assert via.headers["x-other"] == "kept"
    assert handled.headers.get_list("x-tierchain-backend") == ["tower"]
    assert "x-tierchain-backend" not in bare.headers
