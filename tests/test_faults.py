"""After the first byte: every way a backend's socket can fail, through the whole stack.

The gateway is the README's stack (Heartbeats, Budget, PreferBackend, Failover,
Breaker, SaturationWatchdog, Forwarder) on a real uvicorn server; the tower is a
fake backend on a real socket that fails in one way per test. What the caller
receives is checked byte for byte, with the heartbeat lines taken out (and each
checked to sit at an event boundary).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import openai
import pytest

from tierchain import (
    Backend,
    Breaker,
    Budget,
    Failover,
    Forwarder,
    Heartbeats,
    MemoryStore,
    PreferBackend,
    Routes,
    SaturationWatchdog,
    current_attempt,
)

from .support import (
    Exchange,
    FakeBackend,
    answers,
    chat_request,
    completion_body,
    fault,
    on_virtual_time,
    openai_stream,
    serve,
    streams,
)

STATE_LINE = re.compile(rb': \{"state":[^\r\n]*\}\n')
HOSTED = openai_stream(["from ", "hosted"])


def without_state_lines(raw: bytes) -> bytes:
    """``raw`` without heartbeat lines, after checking each sat at an event boundary."""
    out = b""
    pos = 0
    for match in STATE_LINE.finditer(raw):
        out += raw[pos : match.start()]
        pos = match.end()
        assert out == b"" or out.endswith((b"\n\n", b"\r\r", b"\r\n\r\n")), out[-60:]
    return out + raw[pos:]


def error_of(raw: bytes) -> dict[str, Any]:
    """The error object of the stream's last event, which must be an error event."""
    last = without_state_lines(raw).rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"data: ")
    return json.loads(last[6:])["error"]


class Gateway:
    """The README's stack in front of a Forwarder, with short clocks for tests."""

    def __init__(self, chain: list[Backend], **opts: Any) -> None:
        self.store = MemoryStore()
        self.forwarder = Forwarder()
        self.watchdog = SaturationWatchdog(
            self.forwarder,
            slow_after=opts.pop("slow_after", 2.0),
            stall_after=opts.pop("stall_after", 2.0),
            # Each caller meets the fault itself: the breaker's thresholds are tested here
            # (one verdict sparing the next caller: tests/test_shared_normals.py).
            suspect_for=opts.pop("suspect_for", 0),
        )
        breaker = Breaker(
            self.watchdog, store=self.store, failure_threshold=opts.pop("failure_threshold", 5)
        )
        failover = Failover(breaker, routes=Routes({"echo": chain}), **opts)
        self.app = Heartbeats(Budget(PreferBackend(failover), default=5.0), interval=10.0)

    async def aclose(self) -> None:
        await self.forwarder.aclose()
        await self.watchdog.aclose()


async def post(url: str, *, stream: bool = True, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5) as client:
        return await client.post(
            url + "/v1/chat/completions", content=chat_request(stream=stream), **kw
        )


# -- after the first data event: an error event, and the backend is charged ------------


@pytest.mark.parametrize(
    ("kind", "outcome"),
    [("reset", "stream_broken"), ("close", "stream_broken"), ("half_event", "stream_broken")],
)
@on_virtual_time
async def test_a_stream_that_breaks_after_two_events_ends_with_an_error_and_counts(
    kind, outcome, metric
):
    events = openai_stream(["one", "two", "three"])
    before = metric("tierchain_attempts_total", route="echo", backend="tower", outcome=outcome)
    async with FakeBackend("tower", fault(kind)) as tower, FakeBackend("hosted") as hosted:
        # No continuation: the break's own error (hosted finishing it: test_continuation.py).
        gw = Gateway([Backend("tower", tower.url), Backend("hosted", hosted.url)], continuations=0)
        async with serve(gw.app) as url:
            response = await post(url)
        await gw.aclose()
    assert response.status_code == 200
    body = without_state_lines(response.content)
    # The two whole events, then the error: never half an event, never a silent end.
    assert body.startswith(events[0] + events[1] + b'data: {"error":')
    assert body.endswith(b"}}\n\n")
    assert error_of(response.content)["code"] == outcome
    assert hosted.requests == []  # a byte reached the caller: no failover
    after = metric("tierchain_attempts_total", route="echo", backend="tower", outcome=outcome)
    assert after == before + 1


@on_virtual_time
async def test_a_tower_that_keeps_breaking_mid_stream_is_skipped_after_the_threshold():
    async with FakeBackend("tower", fault("reset")) as tower, FakeBackend("hosted") as hosted:
        gw = Gateway(
            [Backend("tower", tower.url), Backend("hosted", hosted.url)],
            failure_threshold=2,
            continuations=0,
        )
        async with serve(gw.app) as url:
            first = await post(url)
            second = await post(url)
            third = await post(url)
        await gw.aclose()
    assert error_of(first.content)["code"] == error_of(second.content)["code"] == "stream_broken"
    assert len(tower.requests) == 2  # the third request never reached it
    assert third.headers["x-tierchain-attempts"] == "tower;outcome=skipped, hosted;outcome=ok"
    assert without_state_lines(third.content) == b"".join(openai_stream(["Hel", "lo"]))


@on_virtual_time
async def test_a_stream_that_ends_without_its_terminator_is_truncated_not_complete(metric):
    events = openai_stream(["one", "two", "three"])
    async with FakeBackend("tower", fault("no_done")) as tower:
        gw = Gateway([Backend("tower", tower.url)])
        async with serve(gw.app) as url:
            response = await post(url)
        await gw.aclose()
    body = without_state_lines(response.content)
    assert body.startswith(events[0] + events[1] + b'data: {"error":')
    assert error_of(response.content)["code"] == "truncated"
    snapshot = await gw.store.breaker_snapshot("echo", "tower")
    assert snapshot.failures == 1


@on_virtual_time
async def test_a_stream_that_stalls_after_commit_ends_stalled_and_closes_the_upstream():
    events = openai_stream(["one", "two", "three"])
    async with FakeBackend("tower", fault("stall")) as tower:
        gw = Gateway([Backend("tower", tower.url)], stall_after=0.2)
        async with serve(gw.app) as url:
            response = await post(url)
            await tower.connection_closed.wait()
        await gw.aclose()
    body = without_state_lines(response.content)
    assert body.startswith(events[0] + events[1] + b'data: {"error":')
    assert error_of(response.content)["code"] == "stalled"
    assert tower.open_connections == 0
    snapshot = await gw.store.breaker_snapshot("echo", "tower")
    assert snapshot.failures == 1


@on_virtual_time
async def test_a_backend_may_stall_for_longer_than_the_default():
    async def slow_gaps(ex: Exchange) -> None:
        events = openai_stream(["one", "two"])
        await ex.head()
        for event in events:
            await ex.write(event)
            await asyncio.sleep(0.15)
        await ex.end()

    async with FakeBackend("tower", slow_gaps) as tower:
        gw = Gateway([Backend("tower", tower.url, stall_after=1.0)], stall_after=0.1)
        async with serve(gw.app) as url:
            response = await post(url)
        await gw.aclose()
    assert without_state_lines(response.content) == b"".join(openai_stream(["one", "two"]))


# -- before the first data event: the chain moves on, the caller notices nothing --------


@pytest.mark.parametrize(("kind", "outcome"), [("garbage", "no_data"), ("comments", "no_data")])
@on_virtual_time
async def test_an_event_stream_without_a_data_event_fails_over(kind, outcome):
    async with (
        FakeBackend("tower", fault(kind)) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        gw = Gateway([Backend("tower", tower.url), Backend("hosted", hosted.url)])
        async with serve(gw.app) as url:
            response = await post(url)
        await gw.aclose()
    assert without_state_lines(response.content) == b"".join(HOSTED)
    assert response.headers["x-tierchain-attempts"] == (
        f"tower;outcome={outcome}, hosted;outcome=ok"
    )


@on_virtual_time
async def test_a_stream_that_is_truncated_before_anything_was_sent_fails_over():
    # A handler of its own that answers one event and the end in one message: nothing
    # had gone to the caller when the stream turned out truncated, so the chain moves on.
    async def handler(scope: Any, receive: Any, send: Any) -> None:
        backend = current_attempt(scope).backend.name
        events = [openai_stream(["one"])[0]] if backend == "tower" else HOSTED
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"".join(events)})

    chain = [Backend("tower", "http://127.0.0.1:9"), Backend("hosted", "http://127.0.0.1:9")]
    app = Heartbeats(Failover(Breaker(handler), routes=Routes({"echo": chain})))
    async with serve(app) as url:
        response = await post(url)
    assert without_state_lines(response.content) == b"".join(HOSTED)
    assert response.headers["x-tierchain-attempts"] == (
        "tower;outcome=truncated, hosted;outcome=ok"
    )


@on_virtual_time
async def test_a_trickling_stream_reaches_the_caller_byte_for_byte():
    events = openai_stream(["one", "two"])
    async with FakeBackend("tower", fault("trickle", ["one", "two"])) as tower:
        gw = Gateway([Backend("tower", tower.url)])
        async with serve(gw.app) as url:
            response = await post(url)
        await gw.aclose()
    assert without_state_lines(response.content) == b"".join(events)


@pytest.mark.parametrize("pieces", [["one", "two"], ["x" * 1000] * 4000])
@on_virtual_time
async def test_an_event_stream_framed_by_content_length_arrives_whole(pieces):
    events = openai_stream(pieces)
    async with FakeBackend("tower", fault("content_length", pieces)) as tower:
        gw = Gateway([Backend("tower", tower.url)])
        async with serve(gw.app) as url:
            response = await post(url)
        await gw.aclose()
    assert response.status_code == 200
    assert response.content.startswith(b': {"state":"attempt"')  # state lines in front
    assert without_state_lines(response.content) == b"".join(events)
    assert "content-length" not in response.headers  # the length changed: chunked


# -- non-stream answers: held until whole --------------------------------------------


def cut_short(kind: str) -> Any:
    body = completion_body("from tower")

    async def script(ex: Exchange) -> None:
        head = (
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        ex._writer.write(head.encode() + body[:20])
        await ex._writer.drain()
        if kind == "reset":
            await ex.reset()
        elif kind == "close":
            await ex.close()
        else:
            await ex.wait_closed_by_peer()
            ex.finished = True

    return script


@pytest.mark.parametrize(
    ("kind", "outcome"),
    [("reset", "stream_broken"), ("close", "stream_broken"), ("stall", "saturated")],
)
@on_virtual_time
async def test_a_non_stream_answer_cut_short_fails_over_unnoticed(kind, outcome):
    """A held answer's window covers the whole answer (issue 20): one that stops mid-body is
    not whole when slow_after ends, so it is a saturation, whatever stall_after says."""
    body = completion_body("from hosted")
    async with (
        FakeBackend("tower", cut_short(kind)) as tower,
        FakeBackend("hosted", answers(200, body)) as hosted,
    ):
        gw = Gateway([Backend("tower", tower.url), Backend("hosted", hosted.url)], stall_after=0.2)
        async with serve(gw.app) as url:
            response = await post(url, stream=False)
        await gw.aclose()
    assert response.status_code == 200
    assert response.content == body
    assert response.headers["content-length"] == str(len(body))
    assert response.headers["x-tierchain-attempts"] == (
        f"tower;outcome={outcome}, hosted;outcome=ok"
    )


@on_virtual_time
async def test_a_whole_json_answer_keeps_an_exact_content_length():
    body = completion_body("from tower")
    async with FakeBackend("tower", answers(200, body)) as tower:
        gw = Gateway([Backend("tower", tower.url)])
        async with serve(gw.app) as url:
            response = await post(url, stream=False)
        await gw.aclose()
    assert response.content == body
    assert response.headers["content-length"] == str(len(body))


# -- every tier refused -----------------------------------------------------------------


@on_virtual_time
async def test_when_every_tier_says_429_the_caller_gets_429_with_the_soonest_retry_after():
    async with (
        FakeBackend(
            "tower", answers(429, b'{"error":{"message":"tower is full"}}', **{"Retry-After": "7"})
        ) as tower,
        FakeBackend(
            "hosted",
            answers(429, b'{"error":{"message":"quota exceeded"}}', **{"Retry-After": "3"}),
        ) as hosted,
    ):
        # (retries=0: the Retry-After is not waited out here; tests/test_retries.py waits)
        gw = Gateway([Backend("tower", tower.url), Backend("hosted", hosted.url)], retries=0)
        async with serve(gw.app) as url:
            response = await post(url, stream=False)
        await gw.aclose()
    assert response.status_code == 429
    assert response.headers["retry-after"] == "3"
    assert response.json()["error"]["type"] == "rate_limit_exceeded"
    attempts = response.json()["error"]["attempts"]
    assert attempts == [
        {
            "backend": "tower",
            "outcome": "http_429",
            "retry_after_s": 7.0,
            "message": "tower is full",
        },
        {
            "backend": "hosted",
            "outcome": "http_429",
            "retry_after_s": 3.0,
            "message": "quota exceeded",
        },
    ]


@on_virtual_time
async def test_when_any_tier_says_503_the_caller_gets_503():
    async with (
        FakeBackend("tower", answers(503, b"overloaded", **{"Retry-After": "2"})) as tower,
        FakeBackend("hosted", answers(429)) as hosted,
    ):
        gw = Gateway([Backend("tower", tower.url), Backend("hosted", hosted.url)], retries=0)
        async with serve(gw.app) as url:
            response = await post(url, stream=False)
        await gw.aclose()
    assert response.status_code == 503
    assert response.headers["retry-after"] == "2"
    assert response.json()["error"]["type"] == "all_backends_busy"
    assert [a["message"] for a in response.json()["error"]["attempts"]] == ["overloaded", "x"]


@on_virtual_time
async def test_a_tier_skipped_as_busy_then_a_429_is_503_not_429():
    async with (
        FakeBackend("tower", streams(["never"])) as tower,
        FakeBackend(
            "hosted", answers(429, b'{"error":{"message":"slow down"}}', **{"Retry-After": "4"})
        ) as hosted,
    ):
        chain = [Backend("tower", tower.url, max_in_flight=1), Backend("hosted", hosted.url)]
        forwarder = Forwarder()
        failover = Failover(
            forwarder, routes=Routes({"echo": chain}), store=MemoryStore(), retries=0
        )
        held = await failover.admission.enter(chain[0], last=False)  # the tower is full
        async with serve(failover) as url:
            response = await post(url, stream=False)
        await failover.admission.leave(held)
        await forwarder.aclose()
    assert tower.requests == []
    assert response.status_code == 503
    assert response.headers["retry-after"] == "4"
    error = response.json()["error"]
    assert error["type"] == "all_backends_busy"
    assert [(a["backend"], a["outcome"]) for a in error["attempts"]] == [
        ("tower", "busy"),
        ("hosted", "http_429"),
    ]
    assert error["attempts"][1]["message"] == "slow down"


# -- the official SDK never takes a broken answer for a whole one ----------------------


@pytest.mark.parametrize("kind", ["no_done", "stall", "reset"])
@on_virtual_time
async def test_the_openai_sdk_raises_on_a_truncated_stalled_or_broken_stream(kind):
    async with FakeBackend("tower", fault(kind)) as tower:
        gw = Gateway([Backend("tower", tower.url)], stall_after=0.2)
        async with serve(gw.app) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
            text = ""
            with pytest.raises(openai.APIError):
                stream = await client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": "hi"}], stream=True
                )
                async for chunk in stream:
                    text += chunk.choices[0].delta.content or ""
            await client.close()
        await gw.aclose()
    assert text == "onetwo"  # what arrived, whole, before the error
