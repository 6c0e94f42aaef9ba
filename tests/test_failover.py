"""Failover + Forwarder over real sockets: the foundation's behaviours."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tierchain import Backend, Failover, Forwarder, Routes
from tierchain._disconnect import WATCH_AFTER

from .support import (
    Exchange,
    FakeBackend,
    answering,
    answers,
    chat_request,
    now,
    on_virtual_time,
    openai_stream,
    parse_sse,
    refused_url,
    serve,
    streams,
)


def gateway(routes: dict[str, list[Backend]], **opts) -> tuple[Failover, Forwarder]:
    forwarder = Forwarder()
    return Failover(forwarder, routes=Routes(routes), **opts), forwarder


async def post(url: str, body: bytes, **kw) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5) as client:
        return await client.post(url + "/v1/chat/completions", content=body, **kw)


@on_virtual_time
async def test_a_refused_connection_fails_over_in_well_under_a_second():
    async with FakeBackend("hosted", streams(["from ", "hosted"])) as hosted:
        app, fwd = gateway(
            {"echo": [Backend("tower", refused_url()), Backend("hosted", hosted.url)]}
        )
        async with serve(app) as url:
            t0 = now()
            response = await post(url, chat_request())
            took = now() - t0
        await fwd.aclose()
    assert response.status_code == 200
    assert took == 0.0  # a refused connect waits for no timer at all
    assert b"".join(openai_stream(["from ", "hosted"])) == response.content
    assert response.headers["x-tierchain-attempts"] == (
        "tower;outcome=connect_refused, hosted;outcome=ok"
    )
    assert response.headers["x-tierchain-backend"] == "hosted"


@on_virtual_time
async def test_a_500_before_anything_was_sent_is_tried_once_more_then_fails_over(metric):
    before = metric("tierchain_attempts_total", route="echo", backend="tower", outcome="http_500")
    async with (
        FakeBackend("tower", answers(500)) as tower,
        FakeBackend("hosted", streams(["ok"])) as hosted,
    ):
        app, fwd = gateway({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]})
        async with serve(app) as url:
            response = await post(url, chat_request())
        await fwd.aclose()
    assert response.status_code == 200
    assert len(tower.requests) == 2  # issue 31: one second try on the same tier
    assert len(hosted.requests) == 1
    assert response.headers["x-tierchain-attempts"] == (
        "tower;outcome=http_500, tower;outcome=http_500, hosted;outcome=ok"
    )
    after = metric("tierchain_attempts_total", route="echo", backend="tower", outcome="http_500")
    assert after == before + 2


@on_virtual_time
async def test_a_400_passes_through_without_failover():
    body = b'{"error":{"message":"bad temperature","type":"invalid_request_error"}}'
    async with (
        FakeBackend("tower", answers(400, body)) as tower,
        FakeBackend("hosted") as hosted,
    ):
        app, fwd = gateway({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]})
        async with serve(app) as url:
            response = await post(url, chat_request())
        await fwd.aclose()
    assert response.status_code == 400
    assert response.content == body
    assert hosted.requests == []
    assert response.headers["x-tierchain-attempts"] == "tower;outcome=http_400"


async def not_found_off_v1(ex: Exchange) -> None:
    """A model server that serves /v1/chat/completions only: anything else is Go's plain
    ``404 page not found`` (what Ollama's router answers for an unknown path)."""
    if ex.request.path == "/v1/chat/completions":
        await streams(["from ", "tower"])(ex)
    else:
        await ex.respond(404, b"404 page not found", {"content-type": "text/plain"})


@on_virtual_time
async def test_a_backend_url_ending_in_v1_404s_and_the_next_tier_answers(caplog):
    async with (
        FakeBackend("tower", not_found_off_v1) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        routes = {"echo": [Backend("tower", tower.url + "/v1"), Backend("hosted", hosted.url)]}
        app, fwd = gateway(routes)
        with caplog.at_level("WARNING", logger="tierchain"):
            async with serve(app) as url:
                response = await post(url, chat_request())
        await fwd.aclose()
    assert [r.path for r in tower.requests] == ["/v1/v1/chat/completions"]
    assert response.status_code == 200
    assert response.content == b"".join(openai_stream(["from ", "hosted"]))
    assert response.headers["x-tierchain-attempts"] == "tower;outcome=http_404, hosted;outcome=ok"
    [line] = [r for r in caplog.records if getattr(r, "event", "") == "dispatch.backend_not_found"]
    assert line.tierchain["backend"] == "tower"
    assert "likely a base-URL mistake" in line.tierchain["hint"]
    assert repr(tower.url) in line.tierchain["hint"]  # the URL it should have been


@on_virtual_time
async def test_a_404_on_the_only_tier_is_a_502_naming_it_not_the_callers_404():
    async with FakeBackend("tower", not_found_off_v1) as tower:
        app, fwd = gateway({"echo": [Backend("tower", tower.url + "/v1/")]})
        async with serve(app) as url:
            response = await post(url, chat_request())
        await fwd.aclose()
    assert response.status_code == 502
    assert response.json()["error"]["attempts"] == [
        {"backend": "tower", "outcome": "http_404", "message": "404 page not found"}
    ]


@on_virtual_time
async def test_a_multi_megabyte_non_ascii_body_reaches_the_second_tier_byte_identical():
    content = ("Grüße, 世界! 🚀 " * 200_000)[:3_000_000]
    body = json.dumps(
        {"model": "echo", "stream": True, "messages": [{"content": content}]}, ensure_ascii=False
    ).encode()
    assert len(body) > 3_000_000
    async with (
        FakeBackend("tower", answers(503)) as tower,
        FakeBackend("hosted", streams(["ok"])) as hosted,
    ):
        app, fwd = gateway({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]})
        async with serve(app) as url:
            response = await post(url, body, headers={"content-type": "application/json"})
        await fwd.aclose()
    assert response.status_code == 200
    assert tower.requests[0].body == body
    assert hosted.requests[0].body == body


@on_virtual_time
async def test_an_oversized_body_gets_413_and_reaches_no_backend():
    async with FakeBackend("tower") as tower:
        app, fwd = gateway({"echo": [Backend("tower", tower.url)]}, max_body=1000)
        async with serve(app) as url:
            response = await post(url, chat_request(content="x" * 2000))
        await fwd.aclose()
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_too_large"
    assert tower.requests == []


@on_virtual_time
async def test_an_unknown_model_gets_404_naming_it_and_the_known_routes():
    async with FakeBackend("tower") as tower:
        app, fwd = gateway(
            {"echo": [Backend("tower", tower.url)], "deep": [Backend("t2", tower.url)]}
        )
        async with serve(app) as url:
            response = await post(url, chat_request(model="nope"))
        await fwd.aclose()
    assert response.status_code == 404
    message = response.json()["error"]["message"]
    assert "'nope'" in message
    assert "deep, echo" in message
    assert tower.requests == []


@pytest.mark.parametrize(
    ("body", "needle"),
    [(b"{not json", "not valid JSON"), (b"[1,2]", "JSON object"), (b'{"stream":true}', "'model'")],
)
@on_virtual_time
async def test_a_body_that_cannot_name_a_route_gets_400(body, needle):
    async with FakeBackend("tower") as tower:
        app, fwd = gateway({"echo": [Backend("tower", tower.url)]})
        async with serve(app) as url:
            response = await post(url, body)
        await fwd.aclose()
    assert response.status_code == 400
    assert needle in response.json()["error"]["message"]
    assert tower.requests == []


@on_virtual_time
async def test_when_every_backend_fails_the_caller_gets_502_listing_each_attempt():
    async with FakeBackend("hosted", answers(503)) as hosted:
        app, fwd = gateway(
            {"echo": [Backend("tower", refused_url()), Backend("hosted", hosted.url)]},
            retries=0,  # (a 503 is tried again once by default: tests/test_retries.py)
        )
        async with serve(app) as url:
            response = await post(url, chat_request())
        await fwd.aclose()
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["type"] == "all_backends_failed"
    assert error["attempts"] == [
        {"backend": "tower", "outcome": "connect_refused"},
        {"backend": "hosted", "outcome": "http_503", "message": "x"},
    ]
    assert response.headers["x-tierchain-attempts"] == (
        "tower;outcome=connect_refused, hosted;outcome=http_503"
    )


@on_virtual_time
async def test_pings_before_the_first_data_event_do_not_commit_the_attempt():
    async def ping_then_die(ex: Exchange) -> None:
        await ex.head()
        await ex.write(b": ping\n\n")
        await ex.reset()

    async with (
        FakeBackend("tower", ping_then_die) as tower,
        FakeBackend("hosted", streams(["saved"])) as hosted,
    ):
        app, fwd = gateway({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]})
        async with serve(app) as url:
            response = await post(url, chat_request())
        await fwd.aclose()
    assert response.status_code == 200
    assert response.content == b"".join(openai_stream(["saved"]))
    assert response.headers["x-tierchain-attempts"].startswith("tower;outcome=stream_broken")


@on_virtual_time
async def test_a_stream_that_dies_after_commit_ends_with_an_error_event_not_a_cut():
    async def dies_midway(ex: Exchange) -> None:
        await ex.head()
        await ex.write(openai_stream(["one"])[0])
        await ex.reset()

    async with (
        FakeBackend("tower", dies_midway) as tower,
        FakeBackend("hosted") as hosted,
    ):
        app, fwd = gateway(
            {"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]},
            continuations=0,  # (with one, hosted finishes it: tests/test_continuation.py)
        )
        async with serve(app) as url:
            response = await post(url, chat_request())
        await fwd.aclose()
    events = parse_sse(response.content)
    assert json.loads(events[0]["data"])["choices"][0]["delta"]["content"] == "one"
    error = json.loads(events[-1]["data"])["error"]
    assert error["code"] == "stream_broken"
    assert hosted.requests == []


@on_virtual_time
async def test_a_caller_that_disconnects_closes_the_upstream_connection():
    started = asyncio.Event()

    async def trickles(ex: Exchange) -> None:
        await ex.head()
        await ex.write(openai_stream(["first"])[0])
        started.set()
        await ex.wait_closed_by_peer()

    async with FakeBackend("tower", trickles) as tower:
        app, fwd = gateway({"echo": [Backend("tower", tower.url)]})
        async with serve(app) as url:
            async with (
                httpx.AsyncClient(timeout=5) as client,
                client.stream("POST", url + "/v1/chat/completions", content=chat_request()) as r,
            ):
                async for _ in r.aiter_raw():
                    break
                await asyncio.wait_for(started.wait(), 1)
            t0 = now()
            await asyncio.wait_for(tower.connection_closed.wait(), 1)
            # Closed at the disconnect watch's first look after the caller left.
            assert now() - t0 <= WATCH_AFTER + 1e-6
            assert tower.open_connections == 0
        await fwd.aclose()


@on_virtual_time
async def test_a_backend_that_answers_garbage_fails_over_and_says_why():
    async def garbage(ex: Exchange) -> None:
        ex._writer.write(b"\x00\xffthis is not HTTP at all\r\n\r\n")
        await ex._writer.drain()
        await ex.reset()

    async with (
        FakeBackend("tower", garbage) as tower,
        FakeBackend("hosted", streams(["fine"])) as hosted,
    ):
        app, fwd = gateway({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]})
        async with serve(app) as url:
            response = await post(url, chat_request())
        await fwd.aclose()
    assert response.status_code == 200
    assert response.content == b"".join(openai_stream(["fine"]))
    first = response.headers["x-tierchain-attempts"].split(", ")[0]
    assert first in {"tower;outcome=protocol_error", "tower;outcome=connection_reset"}


@on_virtual_time
async def test_a_body_that_stops_short_of_its_content_length_reaches_no_backend():
    # The caller promises more body than it sends and hangs up: nothing is forwarded.
    async with FakeBackend("tower") as tower:
        app, fwd = gateway({"echo": [Backend("tower", tower.url)]})
        async with serve(app) as url:
            host, port = url.removeprefix("http://").split(":")
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n"
                + chat_request()
            )
            await writer.drain()
            writer.close()
            await writer.wait_closed()
            await asyncio.sleep(0.05)
        await fwd.aclose()
    assert tower.requests == []


@on_virtual_time
async def test_a_router_that_rewrites_the_scope_still_routes_the_next_attempt():
    # The README's layout: the handler mounted in FastAPI at /v1, inside Failover.
    # Starlette's Mount rewrites the scope it routes (root_path, endpoint, ...): the
    # second attempt must be routed from the scope as it came, not the rewritten one.
    from fastapi import FastAPI

    from tierchain import current_attempt

    seen: list[tuple[str, str, str]] = []
    answer = answering("503")  # the tower answers 503, hosted streams an event and [DONE]

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        name = current_attempt(scope).backend.name
        seen.append((name, scope["path"], scope.get("root_path", "")))
        await answer(scope, receive, send)

    routes = Routes(
        {
            "echo": [
                Backend("tower", "http://127.0.0.1:9"),
                Backend("hosted", "http://127.0.0.1:9"),
            ]
        }
    )
    app = FastAPI()
    app.mount("/v1", handler)
    app.add_middleware(Failover, routes=routes, paths=("/v1/",), retries=0)
    async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
        response = await client.post(
            url + "/v1/chat/completions", json={"model": "echo", "stream": True}
        )
    assert response.status_code == 200
    assert response.content == b"data: {}\n\ndata: [DONE]\n\n"
    assert response.headers["x-tierchain-attempts"] == "tower;outcome=http_503, hosted;outcome=ok"
    assert seen == [
        ("tower", "/v1/chat/completions", "/v1"),
        ("hosted", "/v1/chat/completions", "/v1"),
    ]


@on_virtual_time
async def test_a_guard_callback_that_fails_leaves_the_next_guards_callback_to_run() -> None:
    """The disconnect guards' queue calls each still-guarded request's ``then`` callbacks
    once it has run WATCH_AFTER; one that raises is reported and the others still run."""
    from tierchain._disconnect import DisconnectGuard

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    ran = asyncio.Event()

    def broken() -> None:
        raise RuntimeError("broken")

    first, second = DisconnectGuard(receive), DisconnectGuard(receive)
    try:
        first.enter()
        second.enter()
        assert first.young
        assert second.young
        first.then.append(broken)
        second.then.append(ran.set)
        async with asyncio.timeout(5):
            await ran.wait()
        assert not first.young
        assert first.then == []
        assert [str(c["exception"]) for c in reported] == ["broken"]
    finally:
        first.close()
        second.close()
        loop.set_exception_handler(None)
