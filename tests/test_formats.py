"""Every wire format judged by its own rules, through each format's own SDK.

Anthropic Messages (``anthropic``), OpenAI Responses (``openai`` and the OpenAI
Agents SDK) and Ollama's native NDJSON (``ollama``), through the README's
stack (carrying ``/v1/*`` and ``/api/*``) on a real uvicorn, and through
``tierchain serve`` with its defaults. The upstreams are fakes that speak each
format byte for byte (tests/wire_fakes.py says where each shape comes from).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from tierchain import (
    Backend,
    Breaker,
    Budget,
    Endpoints,
    Failover,
    Forwarder,
    Heartbeats,
    MemoryStore,
    PreferBackend,
    Routes,
    SaturationWatchdog,
)
from tierchain.observer import Observer
from tierchain.wire import recognise

from .support import (
    Exchange,
    FakeBackend,
    Script,
    answers,
    chat_request,
    completion_body,
    on_virtual_time,
    refused_url,
    serve,
)
from .test_serve import START_TIMEOUT, tierchain_serve
from .wire_fakes import (
    ANTHROPIC_OVERLOADED,
    ANTHROPIC_TOO_LONG,
    LLAMA_CPP_TOO_LONG,
    NDJSON,
    OPENAI_TOO_LONG,
    anthropic_message,
    anthropic_stream,
    ollama_chat_lines,
    responses_stream,
    sends,
)

PIECES = ["Hel", "lo"]


def readme_gateway(
    routes: Routes, store: MemoryStore, forwarder: Forwarder, slow_after: float = 45.0
) -> Any:
    """The README's FastAPI stack, carrying ``/v1/*`` and ``/api/*`` at once. Each request
    meets the tower's fault itself (``suspect_for=0``; a verdict sparing the next caller is
    tests/test_shared_normals.py's)."""
    from fastapi import FastAPI

    app = FastAPI()
    app.mount("/v1", forwarder)
    app.mount("/api", forwarder)
    app.add_middleware(SaturationWatchdog, slow_after=slow_after, suspect_for=0)
    app.add_middleware(Breaker, store=store)
    app.add_middleware(Failover, routes=routes, paths=("/v1/", "/api/"))
    app.add_middleware(PreferBackend, store=store)
    app.add_middleware(Budget, default=170.0)
    app.add_middleware(Heartbeats, interval=10.0)
    app.add_middleware(Endpoints, routes=routes, store=store)
    return app


class Gateway:
    def __init__(self, url: str, store: MemoryStore, tower: FakeBackend, hosted: FakeBackend):
        self.url = url
        self.store = store
        self.tower = tower
        self.hosted = hosted
        self.clients: list[Any] = []

    async def failures(self, backend: str = "tower") -> int:
        return (await self.store.breaker_snapshot("echo", backend)).failures

    def anthropic(self) -> anthropic.AsyncAnthropic:
        client = anthropic.AsyncAnthropic(base_url=self.url, api_key="dummy", max_retries=0)
        self.clients.append(client)
        return client

    def openai(self) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="dummy", max_retries=0)
        self.clients.append(client)
        return client

    def ollama(self) -> ollama.AsyncClient:
        client = ollama.AsyncClient(host=self.url)
        self.clients.append(client)
        return client

    async def aclose(self) -> None:
        for client in self.clients:
            await client.close()


@contextlib.asynccontextmanager
async def gateway(
    tower: Script, hosted: Script | None = None, *, slow_after: float = 45.0
) -> AsyncIterator[Gateway]:
    store = MemoryStore()
    forwarder = Forwarder(connect_timeout=2.0)
    async with FakeBackend("tower", tower) as t, FakeBackend("hosted", hosted or tower) as h:
        routes = Routes(
            {
                "echo": [
                    Backend(name="tower", url=t.url, regime="local"),
                    Backend(name="hosted", url=h.url, regime="hosted"),
                ]
            }
        )
        try:
            async with serve(readme_gateway(routes, store, forwarder, slow_after)) as url:
                gw = Gateway(url, store, t, h)
                try:
                    yield gw
                finally:
                    await gw.aclose()
        finally:
            await forwarder.aclose()


def without_comments(raw: bytes) -> bytes:
    return b"".join(line for line in raw.splitlines(keepends=True) if not line.startswith(b":"))


MESSAGES = [{"role": "user", "content": "hi"}]


async def anthropic_text(client: anthropic.AsyncAnthropic) -> str:
    stream = await client.messages.create(
        model="echo", max_tokens=64, messages=MESSAGES, stream=True
    )
    text = ""
    async for event in stream:
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            text += event.delta.text
    return text


# -- the recognised formats ------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "wire"),
    [
        ("/v1/chat/completions", "openai"),
        ("/v1/completions", "openai"),
        ("/v1/embeddings", "openai"),
        ("/v1/responses", "responses"),
        ("/openai/v1/responses/", "responses"),
        ("/v1/messages", "anthropic"),
        ("/api/chat", "ollama"),
        ("/api/generate", "ollama"),
        ("/v1/something/else", "openai"),
    ],
)
def test_a_request_path_names_its_wire_format(path, wire):
    assert recognise(path) == wire


def test_a_backend_or_route_names_an_unknown_wire_format_clearly():
    with pytest.raises(ValueError, match="wire_format must be one of openai, responses"):
        Backend("tower", "http://127.0.0.1:1", wire_format="grpc")
    tower = Backend("tower", "http://127.0.0.1:1")
    with pytest.raises(ValueError, match="route 'echo' wire_format must be one of"):
        Routes({"echo": [tower]}, wire_formats={"echo": "soap"})
    with pytest.raises(ValueError, match="names route 'nope', which is not a route"):
        Routes({"echo": [tower]}, wire_formats={"nope": "anthropic"})
    assert Routes({"echo": [tower]}, wire_formats={"echo": "anthropic"}).wire_format("echo") == (
        "anthropic"
    )


def judged(wire: str, events: list[bytes], content_type: bytes = b"text/event-stream") -> str:
    observer = Observer(wire=wire)
    observer.start(200, [(b"content-type", content_type)])
    for event in events:
        observer.body(event)
    observer.end()
    return observer.verdict()


def test_each_format_is_complete_only_at_its_own_end():
    assert judged("anthropic", anthropic_stream(PIECES)) == "ok"
    assert judged("anthropic", anthropic_stream(PIECES)[:-1]) == "truncated"
    assert judged("responses", responses_stream(PIECES)) == "ok"
    assert judged("responses", responses_stream(PIECES)[:-1]) == "truncated"
    # The upstream's own failed or incomplete answer is whole, not cut short.
    failed = b'event: response.failed\ndata: {"type":"response.failed","response":{}}\n\n'
    assert judged("responses", [*responses_stream(PIECES)[:3], failed]) == "ok"
    lines = ollama_chat_lines(PIECES)
    assert judged("ollama", lines, b"application/x-ndjson") == "ok"
    assert judged("ollama", lines[:-1], b"application/x-ndjson") == "truncated"
    # Split anywhere, an NDJSON line is released only whole.
    observer = Observer(wire="ollama")
    observer.start(200, [(b"content-type", b"application/x-ndjson")])
    whole = b"".join(lines)
    out = [observer.body(whole[i : i + 7]) for i in range(0, len(whole), 7)]
    assert b"".join(out) == whole
    assert all(piece == b"" or piece.endswith(b"\n") for piece in out)


# -- Anthropic Messages through the README stack ----------------------------------------


@on_virtual_time
async def test_a_healthy_anthropic_stream_and_message_pass_clean_through_the_readme_stack(
    metric,
):
    events = anthropic_stream(PIECES)

    async def tower(ex: Exchange) -> None:
        if json.loads(ex.request.body).get("stream"):
            await sends(events)(ex)
        else:
            await ex.respond(200, anthropic_message("Hello"))

    before = metric("tierchain_attempts_total", route="echo", backend="tower", outcome="ok")
    async with gateway(tower) as gw:
        client = gw.anthropic()
        assert await anthropic_text(client) == "Hello"
        async with client.messages.stream(model="echo", max_tokens=64, messages=MESSAGES) as s:
            final = await s.get_final_message()
        assert final.content[0].text == "Hello"  # type: ignore[union-attr]
        assert final.stop_reason == "end_turn"
        message = await client.messages.create(model="echo", max_tokens=64, messages=MESSAGES)
        assert message.content[0].text == "Hello"  # type: ignore[union-attr]
        async with httpx.AsyncClient(timeout=10) as raw:
            body = {"model": "echo", "max_tokens": 64, "messages": MESSAGES, "stream": True}
            got = await raw.post(gw.url + "/v1/messages", json=body)
        assert without_comments(got.content) == b"".join(events)  # nothing appended
        assert await gw.failures() == 0
        assert not gw.hosted.requests
    after = metric("tierchain_attempts_total", route="echo", backend="tower", outcome="ok")
    assert after - before == 4


@on_virtual_time
async def test_an_anthropic_stream_that_dies_mid_way_makes_the_sdk_raise():
    tower = sends(anthropic_stream(PIECES), upto=4, then="reset")
    async with gateway(tower) as gw:
        with pytest.raises(anthropic.APIStatusError, match="failed mid-stream"):
            await anthropic_text(gw.anthropic())
        async with httpx.AsyncClient(timeout=10) as raw:
            body = {"model": "echo", "max_tokens": 64, "messages": MESSAGES, "stream": True}
            got = await raw.post(gw.url + "/v1/messages", json=body)
        assert await gw.failures() == 2
    # hosted, asked to finish the answer (docs/continuation.md), broke the same way.
    assert got.content.endswith(
        b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
        b'"message":"backend \'hosted\' failed mid-stream (stream_broken)"}}\n\n'
    )


@on_virtual_time
async def test_an_anthropic_stream_cut_short_without_message_stop_makes_the_sdk_raise():
    tower = sends(anthropic_stream(PIECES), upto=5)  # a clean end, no message_stop
    async with gateway(tower) as gw:
        with pytest.raises(anthropic.APIStatusError, match="truncated"):
            await anthropic_text(gw.anthropic())
        assert await gw.failures() == 1


@on_virtual_time
async def test_every_tier_failing_after_an_early_commit_makes_the_anthropic_sdk_raise():
    release = asyncio.Event()

    async def tower(ex: Exchange) -> None:
        await ex.head()
        await release.wait()  # nothing until the gateway has committed on its own
        await ex.reset()

    async with gateway(tower, answers(500, b'{"error":"down"}')) as gw:
        stream = await gw.anthropic().messages.create(
            model="echo", max_tokens=64, messages=MESSAGES, stream=True
        )  # returns once Heartbeats committed (no event yet from any backend)
        release.set()
        with pytest.raises(anthropic.APIStatusError, match="all 2 backends"):
            async for _ in stream:
                pass


# -- OpenAI Responses and the Agents SDK --------------------------------------------------


@on_virtual_time
async def test_a_healthy_responses_stream_passes_clean_through_the_readme_stack():
    events = responses_stream(PIECES)
    async with gateway(sends(events)) as gw:
        client = gw.openai()
        stream = await client.responses.create(model="echo", input="hi", stream=True)
        kinds = []
        text = ""
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        assert text == "Hello"
        assert kinds[-1] == "response.completed"
        async with client.responses.stream(model="echo", input="hi") as s:
            final = await s.get_final_response()
        assert final.output_text == "Hello"
        async with httpx.AsyncClient(timeout=10) as raw:
            got = await raw.post(
                gw.url + "/v1/responses", json={"model": "echo", "input": "hi", "stream": True}
            )
        assert without_comments(got.content) == b"".join(events)
        assert await gw.failures() == 0


@on_virtual_time
async def test_a_responses_stream_cut_short_makes_the_sdk_raise():
    # Cut after its first text delta: committed, then ended without response.completed.
    async with gateway(sends(responses_stream(PIECES), upto=5)) as gw:
        client = gw.openai()
        with pytest.raises(openai.APIError, match="truncated"):
            stream = await client.responses.create(model="echo", input="hi", stream=True)
            async for _ in stream:
                pass
        with pytest.raises(openai.APIError, match="truncated"):
            async with client.responses.stream(model="echo", input="hi") as s:
                await s.get_final_response()
    # Cut after its four opening events: no answer yet, so every tier was tried. (A new
    # gateway: two streams broken after commit have opened both breakers above.)
    async with gateway(sends(responses_stream(PIECES), upto=4)) as gw:
        gw.hosted.script = sends(responses_stream(PIECES), upto=4)
        with pytest.raises(openai.APIStatusError, match="all 2 backends") as caught:
            await gw.openai().responses.create(model="echo", input="hi", stream=True)
        assert caught.value.status_code == 502


async def run_agent(base_url: str) -> str:
    from agents import Agent, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="dummy", max_retries=0)
    agent = Agent(
        name="echo", instructions="Say hello.", model=OpenAIResponsesModel("echo", client)
    )
    try:
        result = Runner.run_streamed(agent, "hi")
        async for _ in result.stream_events():
            pass
        return str(result.final_output)
    finally:
        await client.close()


@on_virtual_time
async def test_the_agents_sdk_streams_through_the_readme_stack_and_raises_on_a_broken_stream(
    monkeypatch,
):
    monkeypatch.setenv("OPENAI_API_KEY", "dummy")
    async with gateway(sends(responses_stream(PIECES))) as gw:
        assert await run_agent(gw.url) == "Hello"
        assert await gw.failures() == 0
        gw.tower.script = sends(responses_stream(PIECES), upto=5, then="reset")
        # hosted finishes the broken answer (docs/continuation.md): the agent gets it whole.
        assert await run_agent(gw.url) == "Hello"
        gw.hosted.script = gw.tower.script  # hosted breaks too: the agent's run raises
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            await run_agent(gw.url)


# -- Ollama's native API ------------------------------------------------------------------


@on_virtual_time
async def test_an_ollama_stream_is_relayed_line_by_line_with_no_heartbeat_and_no_own_commit():
    lines = ollama_chat_lines(PIECES)
    release = asyncio.Event()
    held = asyncio.Event()

    async def tower(ex: Exchange) -> None:
        if ex.request.path == "/v1/chat/completions":
            await ex.head()  # a chat stream that stays quiet: Heartbeats commits it
            await held.wait()
            await ex.reset()
            return
        await ex.head(200, NDJSON)
        await release.wait()
        await ex.write(lines[0])
        await release.wait()
        for line in lines[1:]:
            await ex.write(line)
        await ex.end()

    async with gateway(tower) as gw, httpx.AsyncClient(timeout=30) as client:
        body = {"model": "echo", "messages": MESSAGES, "stream": True}
        request = client.build_request("POST", gw.url + "/api/chat", json=body)
        ollama_answer = asyncio.create_task(client.send(request, stream=True))
        # A chat stream started after it is committed by Heartbeats (commit_after):
        # by then the Ollama request has waited longer than that, and was not.
        chat = client.build_request("POST", gw.url + "/v1/chat/completions", content=chat_request())
        quiet = await client.send(chat, stream=True)
        assert quiet.headers["content-type"].startswith("text/event-stream")
        assert not ollama_answer.done()
        release.set()
        response = await ollama_answer
        assert response.headers["content-type"] == "application/x-ndjson"
        pieces = response.aiter_raw()
        first = await anext(pieces)
        assert first == lines[0]  # line by line, as it arrives: not held until whole
        rest = b"".join([p async for p in pieces])
        held.set()
        await quiet.aclose()
    assert first + rest == b"".join(lines)  # no comment line, nothing appended


@on_virtual_time
async def test_the_ollama_client_streams_and_raises_on_a_stream_without_its_done_line():
    lines = ollama_chat_lines(PIECES)
    async with gateway(sends(lines, headers=NDJSON)) as gw:
        client = gw.ollama()
        parts = [p async for p in await client.chat(model="echo", messages=MESSAGES, stream=True)]
        assert "".join(p.message.content or "" for p in parts) == "Hello"
        assert parts[-1].done is True
        assert await gw.failures() == 0
        # Cut before its done line on both tiers: hosted, asked to finish the answer,
        # ends the same way, and the caller gets the tower's own break.
        gw.tower.script = gw.hosted.script = sends(lines[:-1], headers=NDJSON)
        with pytest.raises(ollama.ResponseError, match="truncated"):
            async for _ in await client.chat(model="echo", messages=MESSAGES, stream=True):
                pass
        assert await gw.failures() == 1


# -- failover rules per format ------------------------------------------------------------


@pytest.mark.parametrize(
    "refusal",
    [
        LLAMA_CPP_TOO_LONG,
        OPENAI_TOO_LONG,
        b'{"error":"the input length exceeds the context length"}',
    ],
    ids=["llama.cpp", "openai", "ollama"],
)
@on_virtual_time
async def test_a_context_window_400_from_the_tower_is_answered_by_hosted(refusal, metric):
    before = metric(
        "tierchain_attempts_total", route="echo", backend="tower", outcome="context_exceeded"
    )
    async with gateway(answers(400, refusal), answers(200, completion_body("from hosted"))) as gw:
        response = await gw.openai().chat.completions.with_raw_response.create(
            model="echo", messages=MESSAGES
        )
        assert response.parse().choices[0].message.content == "from hosted"
        assert response.headers["x-tierchain-attempts"] == (
            "tower;outcome=context_exceeded, hosted;outcome=ok"
        )
        assert await gw.failures() == 0
    after = metric(
        "tierchain_attempts_total", route="echo", backend="tower", outcome="context_exceeded"
    )
    assert after - before == 1


@on_virtual_time
async def test_an_anthropic_prompt_too_long_fails_over_and_any_other_400_passes_through():
    async with gateway(
        answers(400, ANTHROPIC_TOO_LONG), answers(200, anthropic_message("hi"))
    ) as gw:
        message = await gw.anthropic().messages.create(
            model="echo", max_tokens=64, messages=MESSAGES
        )
        assert message.content[0].text == "hi"  # type: ignore[union-attr]
        other = b'{"type":"error","error":{"type":"invalid_request_error","message":"bad role"}}'
        gw.tower.script = answers(400, other)
        with pytest.raises(anthropic.BadRequestError, match="bad role"):
            await gw.anthropic().messages.create(model="echo", max_tokens=64, messages=MESSAGES)
        assert len(gw.hosted.requests) == 1  # only the context refusal went on


@on_virtual_time
async def test_an_anthropic_529_overload_fails_over_to_hosted():
    async with gateway(
        answers(529, ANTHROPIC_OVERLOADED), answers(200, anthropic_message("hi"))
    ) as gw:
        message = await gw.anthropic().messages.create(
            model="echo", max_tokens=64, messages=MESSAGES
        )
    assert message.content[0].text == "hi"  # type: ignore[union-attr]


# -- through tierchain serve, with its defaults -------------------------------------------


def by_path(ex: Exchange) -> Script:
    path = ex.request.path
    if path.endswith("/messages"):
        if not json.loads(ex.request.body).get("stream"):
            return answers(200, anthropic_message("Hello"))
        return sends(anthropic_stream(PIECES))
    if path.endswith("/responses"):
        return sends(responses_stream(PIECES))
    return sends(ollama_chat_lines(PIECES), headers=NDJSON)


# Real time: tierchain serve runs in a process of its own, which no virtual clock reaches.
async def test_every_format_passes_clean_through_tierchain_serve_and_a_broken_one_raises(
    tmp_path: Path, monkeypatch
):
    monkeypatch.setenv("OPENAI_API_KEY", "dummy")
    mode = {"now": "healthy"}
    release = asyncio.Event()

    async def tower(ex: Exchange) -> None:
        now = mode["now"]
        if now == "reset":
            await sends(anthropic_stream(PIECES), upto=4, then="reset")(ex)
        elif now == "cut":  # each format's stream, ended cleanly after its first text
            path = ex.request.path
            if path.endswith("/responses"):
                await sends(responses_stream(PIECES), upto=5)(ex)
            else:
                await sends(ollama_chat_lines(PIECES)[:1], headers=NDJSON)(ex)
        elif now == "held":
            await ex.head()
            await release.wait()
            await ex.reset()
        else:
            await by_path(ex)(ex)

    async with FakeBackend("tower", tower) as t:
        routes = tmp_path / "routes.toml"
        routes.write_text(
            f'[[routes.echo.backends]]\nname = "tower"\nurl = "{t.url}"\n'
            f'[[routes.echo.backends]]\nname = "hosted"\nurl = "{refused_url()}"\n'
        )
        env = {
            "TIERCHAIN_ROUTES_FILE": str(routes),
            "TIERCHAIN_LOG_FORMAT": "json",
            # Three streams break on purpose here; by default two mid-stream deaths in a
            # row open the tower's breaker (tests/test_recovery.py), sparing the third.
            "TIERCHAIN_BREAKER_STREAM_FAILURE_THRESHOLD": "5",
            # (and a death marks the tower suspect for the callers after: not here)
            "TIERCHAIN_WATCHDOG_SUSPECT_FOR": "0",
        }
        async with tierchain_serve(env) as served:
            await served.event("tierchain.started", START_TIMEOUT)
            (address,) = (await served.event("serve.listening"))["addresses"]
            url = f"http://{address}"
            clients = Gateway(url, MemoryStore(), t, t)
            try:
                client = clients.anthropic()
                assert await anthropic_text(client) == "Hello"
                async with client.messages.stream(
                    model="echo", max_tokens=64, messages=MESSAGES
                ) as stream:
                    assert (await stream.get_final_message()).stop_reason == "end_turn"
                message = await client.messages.create(
                    model="echo", max_tokens=64, messages=MESSAGES
                )
                assert message.content[0].text == "Hello"  # type: ignore[union-attr]
                oai = clients.openai()
                events = await oai.responses.create(model="echo", input="hi", stream=True)
                assert [e.type async for e in events][-1] == "response.completed"
                async with oai.responses.stream(model="echo", input="hi") as s:
                    assert (await s.get_final_response()).output_text == "Hello"
                assert await run_agent(url) == "Hello"
                local = clients.ollama()
                chat = await local.chat(model="echo", messages=MESSAGES, stream=True)
                parts = [p async for p in chat]
                assert "".join(p.message.content or "" for p in parts) == "Hello"
                async with httpx.AsyncClient(timeout=10) as raw:
                    metrics = (await raw.get(url + "/metrics")).text

                mode["now"] = "reset"
                with pytest.raises(anthropic.APIStatusError, match="failed mid-stream"):
                    await anthropic_text(client)
                mode["now"] = "cut"
                with pytest.raises(openai.APIError, match="truncated"):
                    async with oai.responses.stream(model="echo", input="hi") as s:
                        await s.get_final_response()
                with pytest.raises(ollama.ResponseError, match="truncated"):
                    async for _ in await local.chat(model="echo", messages=MESSAGES, stream=True):
                        pass
                mode["now"] = "held"
                held = await client.messages.create(
                    model="echo", max_tokens=64, messages=MESSAGES, stream=True
                )  # returns once serve's Heartbeats committed the stream on its own
                release.set()
                with pytest.raises(anthropic.APIStatusError, match="all 2 backends"):
                    async for _ in held:
                        pass
            finally:
                await clients.aclose()
    attempts = [
        line for line in metrics.splitlines() if line.startswith("tierchain_attempts_total{")
    ]
    assert attempts
    assert all('outcome="ok"' in line for line in attempts), attempts
    failed = [e["outcome"] for e in served.events() if e.get("event") == "dispatch.stream_failed"]
    assert failed == ["stream_broken", "truncated", "truncated"]  # only those broken on purpose


# -- through the examples ---------------------------------------------------------------


@pytest.mark.parametrize("example", ["fastapi", "litestar"])
@on_virtual_time
async def test_every_format_passes_clean_through_the_examples(example, monkeypatch):
    from asgi_lifespan import LifespanManager

    from examples.fastapi_app import create_app as fastapi_app
    from examples.litestar_app import create_app as litestar_app

    monkeypatch.setenv("OPENAI_API_KEY", "dummy")
    store = MemoryStore()

    async def tower(ex: Exchange) -> None:
        await by_path(ex)(ex)

    async with FakeBackend("tower", tower) as t:
        routes = Routes({"echo": [Backend(name="tower", url=t.url, regime="local")]})
        build = fastapi_app if example == "fastapi" else litestar_app
        app = build(routes, store=store)
        async with LifespanManager(app), serve(app) as url:
            clients = Gateway(url, store, t, t)
            try:
                assert await anthropic_text(clients.anthropic()) == "Hello"
                async with clients.openai().responses.stream(model="echo", input="hi") as s:
                    assert (await s.get_final_response()).output_text == "Hello"
                assert await run_agent(url) == "Hello"
                chat = await clients.ollama().chat(model="echo", messages=MESSAGES, stream=True)
                assert "".join([(p.message.content or "") async for p in chat]) == "Hello"
            finally:
                await clients.aclose()
        assert await clients.failures() == 0
        assert [r.path for r in t.requests] == [
            "/v1/messages",
            "/v1/responses",
            "/v1/responses",
            "/api/chat",
        ]


def test_the_routes_file_takes_a_wire_format_per_backend_and_per_route():
    from tierchain.config import ConfigError, routes_from_toml

    routes = routes_from_toml(
        {
            "routes": {
                "claude": {
                    "wire_format": "anthropic",
                    "backends": [
                        {"name": "tower", "url": "http://127.0.0.1:1", "wire_format": "openai"},
                        {"name": "hosted", "url": "http://127.0.0.1:2"},
                    ],
                },
                "echo": {"backends": [{"name": "tower", "url": "http://127.0.0.1:1"}]},
            }
        }
    )
    assert routes.wire_format("claude") == "anthropic"
    assert routes.wire_format("echo") is None
    assert [b.wire_format for b in routes["claude"]] == ["openai", None]
    with pytest.raises(ConfigError) as caught:
        routes_from_toml(
            {
                "routes": {
                    "echo": {
                        "wire_format": "grpc",
                        "backends": [{"name": "t", "url": "http://127.0.0.1:1", "wire_format": 3}],
                    }
                }
            }
        )
    assert caught.value.problems == (
        "routes.echo.wire_format='grpc': expected one of openai, responses, anthropic, "
        "ollama, plain",
        "routes.echo.backends[0].wire_format=3 (backend 't'): expected one of openai, responses, "
        "anthropic, ollama, plain",
    )


# -- pieces alone, and the format named in code ------------------------------------------


@on_virtual_time
async def test_a_breaker_alone_counts_five_healthy_anthropic_streams_as_successes():
    store = MemoryStore()
    async with FakeBackend("tower", sends(anthropic_stream(PIECES))) as t:
        tower = Backend(name="tower", url=t.url)
        forwarder = Forwarder(backend=tower)
        app = Breaker(forwarder, store=store, failure_threshold=5, backend=tower)
        try:
            async with serve(app) as url:
                client = anthropic.AsyncAnthropic(base_url=url, api_key="dummy", max_retries=0)
                try:
                    texts = [await anthropic_text(client) for _ in range(6)]
                finally:
                    await client.close()
        finally:
            await forwarder.aclose()
    assert texts == ["Hello"] * 6
    snapshot = await store.breaker_snapshot("", "tower")
    assert (snapshot.state, snapshot.failures) == ("closed", 0)


@on_virtual_time
async def test_a_route_or_backend_named_anthropic_in_code_is_judged_so_on_any_path():
    events = anthropic_stream(PIECES)
    async with FakeBackend("tower", sends(events)) as t, FakeBackend("other", sends(events)) as o:
        routes = Routes(
            {
                "claude": [Backend(name="tower", url=t.url)],
                "plain": [Backend(name="other", url=o.url)],
                "mine": [Backend(name="tower", url=t.url, wire_format="anthropic")],
            },
            wire_formats={"claude": "anthropic"},
        )
        forwarder = Forwarder()
        app = Failover(forwarder, routes=routes)
        try:
            async with serve(app) as url, httpx.AsyncClient(timeout=10) as client:
                named = await client.post(url + "/gateway/claude", json={"model": "claude"})
                guessed = await client.post(url + "/gateway/claude", json={"model": "plain"})
                backend = await client.post(url + "/gateway/claude", json={"model": "mine"})
        finally:
            await forwarder.aclose()
    assert named.content == b"".join(events)
    assert named.headers["x-tierchain-attempts"] == "tower;outcome=ok"
    assert backend.content == b"".join(events)  # the backend's own wire_format, likewise
    # The same bytes on a route with no format named, on a path no format claims, are
    # judged by OpenAI's rules: no [DONE], so the stream is truncated.
    assert guessed.content.startswith(b"".join(events))
    assert guessed.content.endswith(b'"code":"truncated"}}\n\n')


@on_virtual_time
async def test_every_tier_failing_after_an_early_commit_makes_the_responses_sdk_raise():
    release = asyncio.Event()

    async def tower(ex: Exchange) -> None:
        await ex.head()
        await release.wait()  # nothing until the gateway has committed on its own
        await ex.reset()

    async with gateway(tower, answers(500, b'{"error":"down"}')) as gw:
        stream = await gw.openai().responses.create(model="echo", input="hi", stream=True)
        release.set()
        with pytest.raises(openai.APIError, match="all 2 backends"):
            async for _ in stream:
                pass


@on_virtual_time
async def test_an_ollama_request_every_tier_fails_gets_its_real_502_after_a_long_wait():
    release = asyncio.Event()

    async def tower(ex: Exchange) -> None:
        if ex.request.path == "/v1/chat/completions":
            await ex.head()  # a chat stream that stays quiet: Heartbeats commits it
            await release.wait()
            await ex.reset()
            return
        await ex.head(200, NDJSON)
        await release.wait()
        await ex.reset()

    async with gateway(tower, answers(500, b'{"error":"down"}')) as gw:
        client = gw.ollama()
        chat = asyncio.create_task(
            client.chat(model="echo", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
        )
        async with httpx.AsyncClient(timeout=30) as raw:
            quiet = await raw.send(
                raw.build_request("POST", gw.url + "/v1/chat/completions", content=chat_request()),
                stream=True,
            )  # committed by Heartbeats: the Ollama request has waited longer than that
            release.set()
            with pytest.raises(ollama.ResponseError) as caught:
                async for _ in await chat:
                    pass
            await quiet.aclose()
    assert caught.value.status_code == 502
    assert "all 2 backends for route 'echo' failed" in str(caught.value)


# -- what counts as progress --------------------------------------------------------------


def test_opening_events_and_pings_are_not_progress():
    events = anthropic_stream(PIECES)
    observer = Observer(wire="anthropic")
    observer.start(200, [(b"content-type", b"text/event-stream")])
    opening = b"".join(events[:3])  # message_start, content_block_start, ping
    assert observer.body(opening) == opening  # passed on (Failover holds it), not progress
    assert observer.first_data_at is None
    assert observer.opened
    observer.body(events[3])  # the first text delta
    first = observer.first_data_at
    assert first is not None
    assert observer.last_event_at == first
    observer.body(b'event: ping\ndata: {"type": "ping"}\n\n')
    assert observer.last_event_at == first  # a ping never moves the stall clock
    responses = Observer(wire="responses")
    responses.start(200, [(b"content-type", b"text/event-stream")])
    for event in responses_stream(PIECES)[:4]:  # created ... content_part.added
        responses.body(event)
    assert responses.first_data_at is None
    responses.body(responses_stream(PIECES)[4])  # the first output_text.delta
    assert responses.first_data_at is not None


@on_virtual_time
async def test_a_tower_that_opens_an_anthropic_answer_then_hangs_fails_over_unseen():
    opening = anthropic_stream(PIECES)[:3]
    hosted_events = anthropic_stream(["from ", "hosted"])

    async def tower(ex: Exchange) -> None:
        await ex.head()
        for event in opening:  # at once, as a server does before its queue or prefill
            await ex.write(event)
        await ex.wait_closed_by_peer()
        ex.finished = True

    async with gateway(tower, sends(hosted_events), slow_after=0.5) as gw:
        assert await anthropic_text(gw.anthropic()) == "from hosted"
        async with httpx.AsyncClient(timeout=30) as raw:
            body = {"model": "echo", "max_tokens": 64, "messages": MESSAGES, "stream": True}
            got = await raw.post(gw.url + "/v1/messages", json=body)
        assert await gw.failures("hosted") == 0
    assert without_comments(got.content) == b"".join(hosted_events)  # nothing of the tower's
    assert b'"state":"backend_saturated","backend":"tower"' in got.content
