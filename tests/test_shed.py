"""Shed over a real socket: past max_concurrent requests in flight, a new one gets 503 at once."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tierchain import Shed
from tierchain.config import from_env
from tierchain.stack import build_stack

from .support import serve


class Held:
    """An SSE endpoint that holds every request until released (or its caller leaves)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = 0
        self.arrived = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.entered += 1
        self.arrived.set()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": b"data: held\n\n", "more_body": True})

        async def caller_left() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        left = asyncio.create_task(caller_left())
        released = asyncio.create_task(self.release.wait())
        try:
            await asyncio.wait([left, released], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (left, released):
                task.cancel()
            await asyncio.wait([left, released])
        if self.release.is_set():
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def test_past_max_concurrent_a_new_request_gets_503_with_retry_after(metric):
    held = Held()
    before = metric("tierchain_shed_requests_total")
    async with (
        serve(Shed(held, max_concurrent=2, retry_after=2.5)) as url,
        httpx.AsyncClient(timeout=5) as client,
    ):
        streams = [client.stream("GET", url + "/v1/x") for _ in range(2)]
        responses = [await s.__aenter__() for s in streams]
        try:
            assert [r.status_code for r in responses] == [200, 200]
            shed = await client.post(url + "/v1/chat/completions", content=b"{}")
            assert shed.status_code == 503
            assert shed.headers["retry-after"] == "3"  # whole seconds, rounded up
            assert shed.json()["error"]["type"] == "overloaded"
            assert shed.json()["error"]["code"] == "gateway_overloaded"
            assert held.entered == 2  # the shed request never reached the app
        finally:
            held.release.set()
            for s in streams:
                await s.__aexit__(None, None, None)
        # Room again once the streams are over.
        async with client.stream("GET", url + "/v1/x") as again:
            assert again.status_code == 200
            assert b"[DONE]" in b"".join([c async for c in again.aiter_raw()])
    assert metric("tierchain_shed_requests_total") == before + 1


async def test_a_caller_that_leaves_gives_its_place_back():
    held = Held()
    shed = Shed(held, max_concurrent=1)
    async with serve(shed) as url, httpx.AsyncClient(timeout=5) as client:
        async with client.stream("GET", url + "/v1/x") as first:
            assert first.status_code == 200
            assert shed.in_flight == 1
        # The caller hung up mid-stream: the app is cancelled and the place is free.
        async with asyncio.timeout(2):
            while shed.in_flight:  # noqa: ASYNC110 - polls the counter the server frees
                await asyncio.sleep(0.01)
        held.release.set()
        response = await client.get(url + "/v1/x")
        assert response.status_code == 200


async def test_without_a_limit_nothing_is_shed():
    held = Held()
    held.release.set()
    app = Shed(held)
    async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
        results = await asyncio.gather(*(client.get(url + "/v1/x") for _ in range(20)))
    assert {r.status_code for r in results} == {200}


@pytest.mark.parametrize(
    "opts", [{"max_concurrent": 0}, {"max_concurrent": 2.5}, {"retry_after": -1}]
)
def test_bad_options_are_refused_at_start_up(opts):
    with pytest.raises(ValueError, match="must be"):
        Shed(lambda *a: None, **opts)  # type: ignore[arg-type]


def test_the_configured_stack_puts_shed_outermost_only_when_a_limit_is_set(tmp_path: Path):
    routes = tmp_path / "routes.toml"
    routes.write_text(
        '[routes.echo]\nbackends = [{ name = "tower", url = "http://127.0.0.1:9" }]\n'
    )
    base = {"TIERCHAIN_ROUTES_FILE": str(routes)}

    def layers(environ: dict[str, str]) -> list[str]:
        node: Any = build_stack(None, from_env(environ), identity=False)
        names = []
        while hasattr(node, "app"):
            names.append(type(node).__name__)
            node = node.app
        return names

    assert "Shed" not in layers(base)
    limited = layers({**base, "TIERCHAIN_SHED_MAX_CONCURRENT": "500"})
    assert limited[limited.index("Shed") + 1] == "Heartbeats"
    settings = from_env({**base, "TIERCHAIN_SHED_MAX_CONCURRENT": "500"})
    assert settings.middleware_kwargs("Shed") == {"max_concurrent": 500}
    assert json.dumps(settings.middleware_kwargs("Shed"))
