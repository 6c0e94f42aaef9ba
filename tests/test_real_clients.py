"""Real SSE clients through the example gateway, heartbeats on, across a failover.

Each client must see exactly the data events the backend sent: the official
openai SDK (sync and async), httpx-sse, ``curl -N`` and headless Chromium's
EventSource on the example's page. The tower tier stays quiet until the
gateway has written heartbeats into the caller's stream, then breaks; the
hosted tier answers with events that carry ``id:`` fields (after which the
openai SDK turns any blank line following a comment into an empty event and
fails) and pauses between events until a keepalive has gone out.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from typing import Any

import httpx
import openai
import pytest
from httpx_sse import aconnect_sse
from prometheus_client import REGISTRY

from examples.fastapi_app import create_app
from tierchain import Backend, Routes

from .support import Exchange, FakeBackend, openai_stream, serve

TICK = 0.05


def heartbeats_written(state: str) -> float:
    value = REGISTRY.get_sample_value("tierchain_stream_heartbeats_total", {"state": state})
    return 0.0 if value is None else value


async def until_heartbeats(state: str, more_than: float) -> None:
    """Wait (bounded) until more than ``more_than`` ``state`` lines have been written."""
    for _ in range(400):  # at most two seconds
        if heartbeats_written(state) > more_than:
            return
        await asyncio.sleep(0.005)
    raise TimeoutError(f"no new {state!r} heartbeat was written")


def hosted_events() -> list[bytes]:
    """The hosted tier's events: an OpenAI stream whose events carry ``id:`` lines."""
    return [b"id: %d\n" % i + event for i, event in enumerate(openai_stream(["Hel", "lo!"]), 1)]


def data_of(events: list[bytes]) -> list[str]:
    return [event.split(b"data: ", 1)[1][:-2].decode() for event in events]


class Scenario:
    """A tower that breaks after two heartbeats; a hosted tier that pauses for keepalives."""

    def __init__(self, *, hosted_answers: bool = True) -> None:
        self.events = hosted_events()
        self.hosted_answers = hosted_answers

    async def tower(self, ex: Exchange) -> None:
        await until_heartbeats("attempt", self.attempts + 1)  # first line + a keepalive
        await ex.reset()

    async def hosted(self, ex: Exchange) -> None:
        await ex.head()
        first, second, *rest = self.events
        await ex.write(first)
        await until_heartbeats("generating", self.generating + 1)  # a keepalive between events
        cut = second.index(b"Hel") if b"Hel" in second else len(second) // 2
        await ex.write(second[:cut])  # an event split inside a JSON string
        await ex.write(second[cut:])
        for event in rest:
            await ex.write(event)
        await ex.end()

    async def __aenter__(self) -> str:
        self.attempts = heartbeats_written("attempt")
        self.generating = heartbeats_written("generating")
        self._tower = await FakeBackend("tower", self.tower).start()
        self._hosted = await FakeBackend("hosted", self.hosted).start()
        chain = [Backend("tower", self._tower.url, regime="local")]
        if self.hosted_answers:
            chain.append(Backend("hosted", self._hosted.url, regime="hosted"))
        app = create_app(Routes({"echo": chain}), heartbeat_interval=TICK, commit_after=TICK)
        self._server = serve(app, lifespan="on")
        return await self._server.__aenter__()

    async def __aexit__(self, *exc: Any) -> None:
        await self._server.__aexit__(*exc)
        await self._tower.stop()
        await self._hosted.stop()

    def expected_chunks(self) -> list[dict[str, Any]]:
        return [json.loads(d) for d in data_of(self.events) if d != "[DONE]"]


def summary(chunks: list[Any]) -> list[tuple[Any, ...]]:
    """What a chunk says, whether it is a parsed SDK object or the raw JSON."""
    out = []
    for c in chunks:
        c = c if isinstance(c, dict) else c.model_dump()
        choice = c["choices"][0]
        out.append((c["id"], choice["delta"].get("content"), choice["finish_reason"]))
    return out


MESSAGES = [{"role": "user", "content": "hi"}]


async def test_the_openai_sdk_async_sees_exactly_the_backend_events():
    scenario = Scenario()
    async with (
        scenario as url,
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="test", max_retries=0) as client,
    ):
        stream = await client.chat.completions.create(
            model="echo",
            messages=MESSAGES,
            stream=True,  # type: ignore[arg-type]
        )
        chunks = [chunk async for chunk in stream]
    assert summary(chunks) == summary(scenario.expected_chunks())
    assert heartbeats_written("attempt") >= scenario.attempts + 3  # tower x2, then hosted


async def test_the_openai_sdk_sync_sees_exactly_the_backend_events():
    scenario = Scenario()

    def consume(url: str) -> list[Any]:
        with openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0) as client:
            stream = client.chat.completions.create(
                model="echo",
                messages=MESSAGES,
                stream=True,  # type: ignore[arg-type]
            )
            with stream:
                return list(stream)

    async with scenario as url:
        chunks = await asyncio.to_thread(consume, url)
    assert summary(chunks) == summary(scenario.expected_chunks())


async def test_the_openai_sdk_raises_api_error_for_an_error_event():
    scenario = Scenario(hosted_answers=False)

    def consume(url: str) -> None:
        with openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0) as client:
            stream = client.chat.completions.create(
                model="echo",
                messages=MESSAGES,
                stream=True,  # type: ignore[arg-type]
            )
            with stream:
                list(stream)

    async with scenario as url:
        with pytest.raises(openai.APIError, match="all 1 backends for route 'echo' failed"):
            await asyncio.to_thread(consume, url)
        async with openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="test", max_retries=0
        ) as client:
            scenario.attempts = heartbeats_written("attempt")
            stream = await client.chat.completions.create(
                model="echo",
                messages=MESSAGES,
                stream=True,  # type: ignore[arg-type]
            )
            with pytest.raises(openai.APIError) as caught:
                async for _ in stream:
                    pass
            await stream.close()
    assert caught.value.body["type"] == "all_backends_failed"  # type: ignore[index]


async def test_httpx_sse_sees_exactly_the_backend_events_and_ids():
    scenario = Scenario()
    async with scenario as url, httpx.AsyncClient(timeout=5) as client:
        body = {"model": "echo", "stream": True, "messages": MESSAGES}
        async with aconnect_sse(client, "POST", url + "/v1/chat/completions", json=body) as es:
            seen = [(sse.id, sse.data) async for sse in es.aiter_sse()]
    expected = data_of(scenario.events)
    assert seen == [(str(i), d) for i, d in enumerate(expected, 1)]


async def test_curl_sees_exactly_the_backend_bytes_between_heartbeat_lines():
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed (apt-get install curl)")
    scenario = Scenario()
    body = json.dumps({"model": "echo", "stream": True, "messages": MESSAGES}).encode()
    async with scenario as url:
        proc = await asyncio.create_subprocess_exec(
            curl,
            "-sSN",
            "--max-time",
            "5",
            "-H",
            "content-type: application/json",
            "--data-binary",
            "@-",
            url + "/v1/chat/completions",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate(body)
    assert proc.returncode == 0, err
    lines = out.split(b"\n")
    ours = [ln for ln in lines if ln.startswith(b': {"state":')]
    assert [json.loads(ln[2:])["state"] for ln in ours][:2] == ["attempt", "attempt"]
    assert b"".join(ln + b"\n" for ln in lines[:-1] if ln not in ours) + lines[-1] == b"".join(
        scenario.events
    )


@pytest.mark.chromium
async def test_chromium_event_source_sees_exactly_the_backend_events(browser):
    scenario = Scenario()
    async with scenario as url:
        page = await browser.new_page()
        try:
            await page.goto(url + "/demo/events?model=echo&prompt=hi")
            await page.wait_for_function(
                "document.getElementById('status').textContent === 'done'", timeout=5000
            )
            seen = await page.eval_on_selector_all(
                "#events li", "els => els.map(e => e.textContent)"
            )
            text = await page.text_content("#text")
        finally:
            await page.close()
    assert seen == data_of(scenario.events)
    assert text == "Hello!"
