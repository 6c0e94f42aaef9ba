"""Heartbeats over real sockets: state lines, keepalives, framing, commit rule, teardown."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from tierchain import Backend, Failover, Forwarder, Heartbeats, Routes, TierRequest
from tierchain._disconnect import WATCH_AFTER
from tierchain._runtime import clock as runtime_clock
from tierchain._runtime import deadlines
from tierchain.heartbeats import KEEPALIVE_SLACK

from .support import (
    Exchange,
    FakeBackend,
    answers,
    busy_for,
    chat_request,
    chunk_event,
    now,
    on_virtual_time,
    one_request,
    openai_stream,
    refused_url,
    serve,
    streams,
)

TICK = 0.05
OURS = re.compile(rb': (\{"state":[^\r\n]*\})\n')


def states(raw: bytes) -> list[dict[str, Any]]:
    """Every heartbeat line in ``raw``, decoded, in order."""
    return [json.loads(m) for m in OURS.findall(raw)]


def without_heartbeats(raw: bytes) -> bytes:
    """``raw`` with every heartbeat line removed, after checking each sat at an event boundary."""
    out = b""
    pos = 0
    for m in OURS.finditer(raw):
        out += raw[pos : m.start()]
        pos = m.end()
        assert out == b"" or out.endswith(BLANK_LINE_ENDS), f"inserted mid-event: {out[-40:]!r}"
        if out.endswith(b"\r"):
            later = OURS.sub(b"", raw[pos:])
            assert not later.startswith(b"\n"), "inserted between a CR and its LF"
    return out + raw[pos:]


BLANK_LINE_ENDS = (b"\n\n", b"\r\r", b"\n\r", b"\r\n\r\n", b"\n\r\n", b"\r\n\n")


def stack(routes: dict[str, list[Backend]], **opts: Any) -> tuple[Heartbeats, Forwarder]:
    forwarder = Forwarder()
    opts.setdefault("interval", TICK)
    return Heartbeats(Failover(forwarder, routes=Routes(routes)), **opts), forwarder


class Reader:
    """Reads a streamed response chunk by chunk, keeping the raw bytes and their times."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._it: AsyncIterator[bytes] = response.aiter_raw()
        self.raw = b""
        self.times: list[tuple[float, bytes]] = []

    async def until(self, cond: Any, within: float = 2.0) -> None:
        async with asyncio.timeout(within):
            while not cond(self.raw):
                chunk = await anext(self._it)
                self.times.append((now(), chunk))
                self.raw += chunk

    async def rest(self) -> bytes:
        async with asyncio.timeout(3):
            async for chunk in self._it:
                self.raw += chunk
        return self.raw

    async def aclose(self) -> None:
        await self._it.aclose()  # type: ignore[attr-defined]


def count(raw: bytes, **match: Any) -> int:
    return sum(1 for s in states(raw) if all(s.get(k) == v for k, v in match.items()))


def tierchain_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("tierchain")]


async def no_tierchain_tasks_within(seconds: float) -> list[asyncio.Task[Any]]:
    for _ in range(int(seconds / 0.01)):
        if not tierchain_tasks():
            break
        await asyncio.sleep(0.01)
    return tierchain_tasks()


def held(release: asyncio.Event, then: Any) -> Any:
    """A script that waits for ``release`` before running ``then``."""

    async def script(ex: Exchange) -> None:
        await release.wait()
        await then(ex)

    return script


# -- state lines ------------------------------------------------------------------


@on_virtual_time
async def test_a_fast_two_tier_failover_keeps_real_headers_and_shows_every_attempt_first():
    async with FakeBackend("hosted", streams(["from ", "hosted"])) as hosted:
        app, fwd = stack(
            {
                "echo": [
                    Backend("tower", refused_url(), regime="local"),
                    Backend("hosted", hosted.url),
                ]
            },
            commit_after=5.0,
        )
        async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
            response = await client.post(url + "/v1/chat/completions", content=chat_request())
        await fwd.aclose()
    assert response.status_code == 200
    assert response.headers["x-tierchain-attempts"] == (
        "tower;outcome=connect_refused, hosted;outcome=ok"
    )
    assert states(response.content) == [
        {"state": "attempt", "n": 1, "of": 2, "backend": "tower", "regime": "local"},
        {
            "state": "backend_failed",
            "backend": "tower",
            "reason": "connect_refused",
            "failing_over": True,
        },
        {"state": "attempt", "n": 2, "of": 2, "backend": "hosted", "regime": None},
        {"state": "generating", "backend": "hosted"},
    ]
    # Every state line comes before the first data event, and the data is untouched.
    assert response.content.index(b"data:") > response.content.rindex(b'"generating"')
    assert without_heartbeats(response.content) == b"".join(openai_stream(["from ", "hosted"]))


@on_virtual_time
async def test_a_slow_two_tier_failover_commits_and_shows_each_state_as_it_happens():
    release = asyncio.Event()

    async def reset(ex: Exchange) -> None:
        await ex.reset()

    async with (
        FakeBackend("tower", held(release, reset)) as tower,
        FakeBackend("hosted", streams(["ok"])) as hosted,
    ):
        app, fwd = stack(
            {"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]},
            commit_after=TICK,
            interval=0,
        )
        async with (
            serve(app) as url,
            httpx.AsyncClient(timeout=5) as client,
            client.stream("POST", url + "/v1/chat/completions", content=chat_request()) as resp,
        ):
            reader = Reader(resp)
            try:
                await reader.until(lambda raw: count(raw, state="attempt") == 1)
                assert resp.status_code == 200
                assert resp.headers["content-type"].startswith("text/event-stream")
                assert resp.headers["cache-control"] == "no-cache"
                assert resp.headers["x-accel-buffering"] == "no"
                assert b"data:" not in reader.raw
                release.set()
                raw = await reader.rest()
            finally:
                await reader.aclose()
        await fwd.aclose()
    assert [s["state"] for s in states(raw)] == [
        "attempt",
        "backend_failed",
        "attempt",
        "generating",
    ]
    assert states(raw)[1] == {
        "state": "backend_failed",
        "backend": "tower",
        "reason": "connection_reset",
        "failing_over": True,
    }
    assert without_heartbeats(raw) == b"".join(openai_stream(["ok"]))


# -- keepalives -----------------------------------------------------------------------


@on_virtual_time
async def test_keepalives_repeat_the_current_state_line_at_the_interval():
    release = asyncio.Event()
    async with FakeBackend("tower", held(release, streams(["late"]))) as tower:
        app, fwd = stack({"echo": [Backend("tower", tower.url)]}, commit_after=TICK)
        async with (
            serve(app) as url,
            httpx.AsyncClient(timeout=5) as client,
            client.stream("POST", url + "/v1/chat/completions", content=chat_request()) as resp,
        ):
            reader = Reader(resp)
            try:
                await reader.until(lambda raw: count(raw, state="attempt") >= 4)
                release.set()
                raw = await reader.rest()
            finally:
                await reader.aclose()
        await fwd.aclose()
    attempt = {"state": "attempt", "n": 1, "of": 1, "backend": "tower", "regime": None}
    lines = states(raw)
    assert lines[:4] == [attempt] * 4
    assert lines[-1] == {"state": "generating", "backend": "tower"}
    beats = [t for t, chunk in reader.times if b'"attempt"' in chunk]
    gaps = [b - a for a, b in itertools.pairwise(beats)]
    # A lone stream's keepalive comes exactly ``interval`` after its last output
    # (docs/heartbeats.md): never late, and with no stream to share a wake with, never early.
    assert gaps == [pytest.approx(TICK, abs=1e-6)] * len(gaps), gaps
    assert without_heartbeats(raw) == b"".join(openai_stream(["late"]))


@on_virtual_time
async def test_interval_zero_keeps_the_state_lines_and_drops_the_keepalives():
    release = asyncio.Event()
    async with FakeBackend("tower", held(release, streams(["late"]))) as tower:
        app, fwd = stack({"echo": [Backend("tower", tower.url)]}, commit_after=TICK, interval=0)
        async with (
            serve(app) as url,
            httpx.AsyncClient(timeout=5) as client,
            client.stream("POST", url + "/v1/chat/completions", content=chat_request()) as resp,
        ):
            reader = Reader(resp)
            try:
                await reader.until(lambda raw: count(raw, state="attempt") >= 1)
                await asyncio.sleep(5 * TICK)  # five would-be keepalive intervals
                release.set()
                raw = await reader.rest()
            finally:
                await reader.aclose()
        await fwd.aclose()
    assert [s["state"] for s in states(raw)] == ["attempt", "generating"]


# -- framing ----------------------------------------------------------------------------


@on_virtual_time
async def test_a_split_upstream_event_reaches_the_caller_whole_while_keepalives_flow():
    """Cut inside a JSON string, and between the CR and LF of a CRLF blank line."""
    gaps = [asyncio.Event() for _ in range(5)]
    first = chunk_event("one")
    second = chunk_event("split right here")
    cut = second.index(b"right") + 2
    third = chunk_event("crlf").replace(b"\n\n", b"\r\n\r\n")
    upstream = [first, second[:cut], second[cut:], third[:-1], third[-1:], b"data: [DONE]\n\n"]

    async def script(ex: Exchange) -> None:
        await ex.head()
        await ex.write(upstream[0])
        await gaps[0].wait()
        await ex.write(upstream[1])  # cut inside a JSON string
        await gaps[1].wait()
        await ex.write(upstream[2])
        await gaps[2].wait()
        await ex.write(upstream[3])  # ends "\r\n\r": an LF may still follow
        await gaps[3].wait()
        await ex.write(upstream[4])  # the LF that completes it
        await gaps[4].wait()
        await ex.write(upstream[5])
        await ex.end()

    async with FakeBackend("tower", script) as tower:
        app, fwd = stack({"echo": [Backend("tower", tower.url)]}, commit_after=5.0)
        async with (
            serve(app) as url,
            httpx.AsyncClient(timeout=5) as client,
            client.stream("POST", url + "/v1/chat/completions", content=chat_request()) as resp,
        ):
            reader = Reader(resp)
            try:
                # Between whole events, keepalives flow at the interval.
                await reader.until(lambda raw: raw.endswith(first) or OURS.search(raw[-200:]))
                await reader.until(lambda raw: count(raw, state="generating") >= 3)
                gaps[0].set()
                before = count(reader.raw, state="generating")
                await asyncio.sleep(4 * TICK)  # half an event sits upstream meanwhile
                # The caller never sees half an event, and keepalives keep flowing
                # (its stream stands at a boundary).
                assert upstream[1] not in reader.raw
                await reader.until(lambda raw: count(raw, state="generating") > before)
                gaps[1].set()
                await reader.until(lambda raw: second in raw)
                assert reader.raw.count(second) == 1
                gaps[2].set()
                await reader.until(lambda raw: raw.endswith(upstream[3]))
                await asyncio.sleep(4 * TICK)  # keepalives fall due after the lone CR
                assert reader.raw.endswith(upstream[3])
                gaps[3].set()
                await reader.until(lambda raw: OURS.search(raw[raw.rindex(b"crlf") :]))
                gaps[4].set()
                raw = await reader.rest()
            finally:
                await reader.aclose()
        await fwd.aclose()
    assert without_heartbeats(raw) == b"".join(upstream)
    assert b"\r\n\r\n" + b': {"state"' in raw  # the CRLF event closed before any line
    assert b"\r: {" not in raw


@on_virtual_time
async def test_a_blank_line_never_follows_a_heartbeat():
    release = asyncio.Event()

    async def script(ex: Exchange) -> None:
        await ex.head()
        await ex.write(b"id: 1\ndata: " + json.dumps({"a": 1}).encode() + b"\n\n")
        await release.wait()
        await ex.write(b"id: 2\ndata: [DONE]\n\n")
        await ex.end()

    async with FakeBackend("tower", script) as tower:
        app, fwd = stack({"echo": [Backend("tower", tower.url)]})
        async with (
            serve(app) as url,
            httpx.AsyncClient(timeout=5) as client,
            client.stream("POST", url + "/v1/chat/completions", content=chat_request()) as resp,
        ):
            reader = Reader(resp)
            try:
                await reader.until(lambda raw: count(raw, state="generating") >= 3)
                release.set()
                raw = await reader.rest()
            finally:
                await reader.aclose()
        await fwd.aclose()
    for m in OURS.finditer(raw):
        assert not raw[m.end() :].startswith((b"\n", b"\r")), raw
    assert re.search(rb"\}\n\n", raw.replace(b'{"a": 1}\n\n', b"")) is None


@on_virtual_time
async def test_names_and_reasons_cannot_inject_a_line_break():
    async def app(scope: Any, receive: Any, send: Any) -> None:
        req = TierRequest.of(scope)
        req.emit("backend_failed", backend="evil\n\ndata: x", reason="a\r\nb", failing_over=True)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": b"data: ok\n\n"})

    async with serve(Heartbeats(app, interval=TICK)) as url, httpx.AsyncClient() as client:
        response = await client.post(url, content=b"{}", headers={"accept": "text/event-stream"})
    head, rest = response.content.split(b"\n", 1)
    assert head.startswith(b": {")
    assert json.loads(head[2:])["backend"] == "evil\n\ndata: x"
    assert rest.startswith(b': {"state":"generating"}\ndata: ok\n\n')


# -- the commit rule ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "status"),
    [("backend_400", 400), ("unknown_model", 404), ("too_large", 413), ("all_refused", 502)],
)
@on_virtual_time
async def test_a_fast_failure_keeps_its_real_status(case, status):
    body = chat_request()
    async with FakeBackend("tower", answers(400)) as tower:
        chain = [Backend("tower", tower.url if case == "backend_400" else refused_url())]
        heart = Heartbeats(
            Failover(fwd := Forwarder(), routes=Routes({"echo": chain}), max_body=2000),
            interval=TICK,
            commit_after=0.25,
        )
        if case == "unknown_model":
            body = chat_request(model="nope")
        elif case == "too_large":
            body = chat_request(content="x" * 5000)
        async with serve(heart) as url, httpx.AsyncClient(timeout=5) as client:
            response = await client.post(url + "/v1/chat/completions", content=body)
        await fwd.aclose()
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    assert "error" in response.json()
    assert not OURS.search(response.content)


@on_virtual_time
async def test_a_slow_failure_becomes_an_sse_error_event_and_ends_the_stream():
    release = asyncio.Event()

    async def reset(ex: Exchange) -> None:
        await ex.reset()

    async with FakeBackend("tower", held(release, reset)) as tower:
        app, fwd = stack({"echo": [Backend("tower", tower.url)]}, commit_after=TICK)
        async with (
            serve(app) as url,
            httpx.AsyncClient(timeout=5) as client,
            client.stream("POST", url + "/v1/chat/completions", content=chat_request()) as resp,
        ):
            reader = Reader(resp)
            try:
                await reader.until(lambda raw: count(raw, state="attempt") >= 1)
                release.set()
                raw = await reader.rest()
            finally:
                await reader.aclose()
        await fwd.aclose()
    assert resp.status_code == 200
    assert states(raw)[-1] == {
        "state": "backend_failed",
        "backend": "tower",
        "reason": "connection_reset",
        "failing_over": False,
    }
    tail = without_heartbeats(raw)
    assert tail.startswith(b"data: ")
    assert tail.endswith(b"\n\n")
    assert tail.count(b"\n\n") == 1
    error = json.loads(tail[len(b"data: ") :])["error"]
    assert error["type"] == "all_backends_failed"
    assert error["attempts"] == [{"backend": "tower", "outcome": "connection_reset"}]


@on_virtual_time
async def test_a_non_streaming_request_passes_through_byte_for_byte():
    release = asyncio.Event()
    body = json.dumps({"id": "x", "choices": []}).encode()
    async with FakeBackend("tower", held(release, answers(200, body))) as tower:
        app, fwd = stack({"echo": [Backend("tower", tower.url)]}, commit_after=0.01)

        async def later() -> None:
            await asyncio.sleep(4 * TICK)  # well past commit_after
            release.set()

        async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
            task = asyncio.create_task(later())
            response = await client.post(
                url + "/v1/chat/completions", content=chat_request(stream=False)
            )
            await task
        await fwd.aclose()
    assert response.status_code == 200
    assert response.content == body
    assert response.headers["content-type"] == "application/json"


@on_virtual_time
async def test_alone_in_front_of_any_sse_endpoint_it_reads_stream_true_from_the_body():
    go = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen = b""
        while True:
            message = await receive()
            seen += message.get("body", b"")
            if not message.get("more_body"):
                break
        assert json.loads(seen)["stream"] is True
        await go.wait()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": b"data: hi\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    heart = Heartbeats(app, interval=TICK, commit_after=TICK)
    async with (
        serve(heart) as url,
        httpx.AsyncClient(timeout=5) as client,
        client.stream("POST", url, content=chat_request()) as resp,
    ):
        reader = Reader(resp)
        try:
            await reader.until(lambda raw: count(raw, state="waiting") >= 2)
            go.set()
            raw = await reader.rest()
        finally:
            await reader.aclose()
    assert states(raw)[-1] == {"state": "generating"}
    assert without_heartbeats(raw) == b"data: hi\n\ndata: [DONE]\n\n"


# -- teardown -----------------------------------------------------------------------------------


async def hang_until_closed(ex: Exchange) -> None:
    await ex.wait_closed_by_peer()


@on_virtual_time
async def test_a_caller_leaving_mid_wait_leaves_nothing_running():
    async with FakeBackend("tower", hang_until_closed) as tower:
        app, fwd = stack({"echo": [Backend("tower", tower.url)]}, commit_after=TICK)
        async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
            async with client.stream(
                "POST", url + "/v1/chat/completions", content=chat_request()
            ) as resp:
                reader = Reader(resp)
                try:
                    await reader.until(lambda raw: count(raw, state="attempt") >= 2)
                finally:
                    await reader.aclose()
            async with asyncio.timeout(0.5):
                await tower.connection_closed.wait()
            assert await no_tierchain_tasks_within(0.5) == []
        await fwd.aclose()


@on_virtual_time
async def test_a_caller_leaving_mid_stream_leaves_nothing_running():
    async def script(ex: Exchange) -> None:
        await ex.head()
        await ex.write(chunk_event("first"))
        await ex.wait_closed_by_peer()

    async with FakeBackend("tower", script) as tower:
        app, fwd = stack({"echo": [Backend("tower", tower.url)]}, commit_after=5.0)
        async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
            async with client.stream(
                "POST", url + "/v1/chat/completions", content=chat_request()
            ) as resp:
                reader = Reader(resp)
                try:
                    await reader.until(lambda raw: count(raw, state="generating") >= 2)
                finally:
                    await reader.aclose()
            async with asyncio.timeout(0.5):
                await tower.connection_closed.wait()
            assert await no_tierchain_tasks_within(0.5) == []
        await fwd.aclose()


# -- observability and options -------------------------------------------------------------------


async def _one_stream(event: str, **fields: Any) -> list[dict[str, Any]]:
    """One streaming request through Heartbeats whose app emits ``event`` (with ``fields``,
    in their order) and then answers one data event: what the caller was sent."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        TierRequest.of(scope).emit(event, **fields)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": b"data: x\n\n"})

    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/",
        "headers": [(b"accept", b"text/event-stream")],
    }
    await Heartbeats(app, interval=TICK)(scope, receive, send)
    return sent


@on_virtual_time
async def test_each_line_counts_and_adds_a_span_event(metric):
    before = metric("tierchain_stream_heartbeats_total", state="still_working")
    span = TracerProvider().get_tracer("test").start_span("request")
    with trace.use_span(span, end_on_exit=True):
        sent = await _one_stream("still_working", backend="tower", elapsed_s=1.0)
    assert metric("tierchain_stream_heartbeats_total", state="still_working") == before + 1
    assert [(e.name, dict(e.attributes or {})) for e in span.events] == [
        ("stream.heartbeat", {"state": "still_working", "keepalive": False}),
        ("stream.heartbeat", {"state": "generating", "keepalive": False}),
    ]
    assert sent[1]["body"].startswith(
        b': {"state":"still_working","backend":"tower","elapsed_s":1.0}\n'
    )


@on_virtual_time
async def test_a_batch_of_state_lines_seen_before_is_written_and_counted_as_the_first_time(metric):
    # The same events, twice, then with their keys in another order: each request's first
    # chunk carries its own lines, in its own key order, and each line is counted.
    orders = [("n", "backend"), ("n", "backend"), ("backend", "n")]
    bodies: list[bytes] = []
    fields: dict[str, Any] = {"n": 1, "backend": "tower"}
    for order in orders:
        before = [
            metric("tierchain_stream_heartbeats_total", state=s) for s in ("attempt", "generating")
        ]
        sent = await _one_stream("attempt", **{k: fields[k] for k in order})
        after = [
            metric("tierchain_stream_heartbeats_total", state=s) for s in ("attempt", "generating")
        ]
        assert after == [before[0] + 1, before[1] + 1]
        bodies.append(sent[1]["body"])
    generating = b': {"state":"generating"}\n'
    assert (
        bodies[0]
        == bodies[1]
        == b': {"state":"attempt","n":1,"backend":"tower"}\n' + generating + b"data: x\n\n"
    )
    assert (
        bodies[2]
        == b': {"state":"attempt","backend":"tower","n":1}\n' + generating + b"data: x\n\n"
    )


@pytest.mark.parametrize(
    "opts",
    [{"interval": -1}, {"interval": float("nan")}, {"commit_after": -0.5}, {"max_queued": 0}],
)
def test_bad_options_are_refused_at_start_up(opts):
    with pytest.raises(ValueError, match="must be"):
        Heartbeats(lambda *a: None, **opts)  # type: ignore[arg-type]


@on_virtual_time
async def test_a_late_refusal_that_is_not_json_becomes_a_wrapped_error_event():
    committed = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await committed.wait()
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [(b"content-type", b"text/plain")],
            }
        )
        await send({"type": "http.response.body", "body": b"over", "more_body": True})
        await send({"type": "http.response.body", "body": b"loaded"})

    heart = Heartbeats(app, interval=0, commit_after=TICK)
    async with (
        serve(heart) as url,
        httpx.AsyncClient(timeout=5) as client,
        client.stream("POST", url, headers={"accept": "text/event-stream"}) as resp,
    ):
        reader = Reader(resp)
        try:
            await reader.until(lambda raw: count(raw, state="waiting") >= 1)
            committed.set()
            raw = await reader.rest()
        finally:
            await reader.aclose()
    assert resp.status_code == 200
    assert without_heartbeats(raw) == (
        b'data: {"error":{"message":"the gateway answered 503: overloaded",'
        b'"type":"upstream_error","code":"http_503"}}\n\n'
    )


@on_virtual_time
async def test_still_working_events_not_yet_shown_collapse_into_the_latest():
    async def app(scope: Any, receive: Any, send: Any) -> None:
        req = TierRequest.of(scope)
        req.emit("attempt", n=1, of=1, backend="tower", regime=None)
        for elapsed in (1.0, 2.0, 3.0):
            req.emit("still_working", backend="tower", elapsed_s=elapsed)
        await asyncio.sleep(3 * TICK)  # past commit_after: the queue is shown at the commit
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": b"data: x\n\n"})

    heart = Heartbeats(app, interval=0, commit_after=TICK)
    async with serve(heart) as url, httpx.AsyncClient(timeout=5) as client:
        response = await client.post(url, headers={"accept": "text/event-stream"})
    assert [(s["state"], s.get("elapsed_s")) for s in states(response.content)] == [
        ("attempt", None),
        ("still_working", 3.0),
        ("generating", None),
    ]


@on_virtual_time
async def test_a_keepalive_never_lands_inside_an_event_whose_send_is_still_in_flight():
    # The caller reads slowly: the send that completes an event blocks while
    # several keepalive intervals pass. The bytes handed over already end at a
    # boundary, but they have not gone out yet: a keepalive must not overtake
    # them and land between the event's halves.
    release = asyncio.Event()
    halves_sent = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": b'data: {"a":', "more_body": True})
        await send({"type": "http.response.body", "body": b" 1}\n\n", "more_body": True})
        halves_sent.set()
        await asyncio.sleep(TICK * 3)  # silence: keepalives are due now
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    written: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            if message["body"].endswith(b" 1}\n\n"):
                await release.wait()  # a slow reader: the send that ends the event lags
            written.append(message["body"])

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/",
        "headers": [(b"accept", b"text/event-stream")],
    }
    task = asyncio.create_task(
        Heartbeats(app, interval=TICK / 2, commit_after=TICK)(scope, receive, send)
    )
    await asyncio.sleep(TICK * 3)  # several intervals pass while the first half is in flight
    release.set()
    await asyncio.wait_for(halves_sent.wait(), 1)
    await asyncio.wait_for(task, 1)
    stream = b"".join(written)
    before, event, after = stream.partition(b'data: {"a": 1}\n\n')
    assert event  # the event arrived whole: nothing slipped between its halves
    assert before == b': {"state":"generating"}\n'  # the state line, in front of it
    # keepalives flowed after it, saying how long the stream has been quiet
    assert after.count(b': {"state":"generating","idle_s":') >= 1


class Parked:
    """Streams parked until ``release``: an app that sends nothing, a caller that stays."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.scope = {
            "type": "http",
            "method": "GET",
            "path": "/",
            "headers": [(b"accept", b"text/event-stream")],
        }

    async def app(self, scope: Any, receive: Any, send: Any) -> None:
        await self.release.wait()

    async def receive(self) -> dict[str, Any]:
        await self.release.wait()
        return {"type": "http.disconnect"}


@on_virtual_time
async def test_many_waiting_streams_share_one_timer_and_no_task_while_they_wait():
    parked = Parked()
    release, app, receive, scope = parked.release, parked.app, parked.receive, parked.scope

    outputs: list[list[bytes]] = [[] for _ in range(100)]

    def sender(out: list[bytes]) -> Any:
        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                out.append(message["body"])

        return send

    hb = Heartbeats(app, interval=TICK, commit_after=TICK)
    loop = asyncio.get_running_loop()

    def timers() -> int:  # (a cancelled timer stays in the loop's heap for a while)
        return sum(1 for h in loop._scheduled if not h.cancelled())  # type: ignore[attr-defined]

    timers_before = timers()
    requests = [asyncio.create_task(hb(dict(scope), receive, sender(out))) for out in outputs]
    try:
        async with asyncio.timeout(5):
            while min(len(out) for out in outputs) < 4:  # the commit's lines, then keepalives
                await asyncio.sleep(TICK / 5)
                # One timer for them all; a write is a task that runs once and ends
                # (none is left waiting between two lines).
                assert timers() <= timers_before + 2  # ours, and this test's own timeout
                parked = [
                    t
                    for t in tierchain_tasks()
                    if inspect.getcoroutinestate(t.get_coro()) == inspect.CORO_SUSPENDED
                ]
                assert parked == []
    finally:
        release.set()
        await asyncio.wait(requests)
    for out in outputs:
        assert out[0] == b': {"state":"waiting"}\n'
        assert out[1:4] == [b': {"state":"waiting"}\n'] * 3
    assert tierchain_tasks() == []


@on_virtual_time
async def test_keepalives_due_close_together_share_one_wake_and_none_comes_late():
    parked = Parked()
    release, app, receive, scope = parked.release, parked.app, parked.receive, parked.scope

    written: list[list[float]] = [[] for _ in range(3)]

    def sender(times: list[float]) -> Any:
        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                times.append(now())

        return send

    interval = 10.0
    hb = Heartbeats(app, interval=interval, commit_after=1.0)
    assert hb.slack == interval * KEEPALIVE_SLACK == 1.0
    t0 = now()
    requests = []
    # Three streams committed at 1.0, 1.6 and 2.5 s: the first two keepalives are due within
    # the slack of each other, the third is not.
    for at, times in zip((0.0, 0.6, 1.5), written, strict=True):
        await asyncio.sleep(at - (now() - t0))
        requests.append(asyncio.create_task(hb(dict(scope), receive, sender(times))))
    try:
        await asyncio.sleep(1.5 + 2 * interval + 0.5)
    finally:
        release.set()
        await asyncio.wait(requests)
    # (the commit's line, two keepalives; then the end of each stream at the release)
    first, second, third = ([round(t - t0, 6) for t in times[:3]] for times in written)
    assert first == [1.0, 11.0, 21.0]  # alone at each wake: on time
    # With the first's wake, 0.6 s early (within 1.0); then with it, on time: early once.
    assert second == [1.6, 11.0, 21.0]
    assert third == [2.5, 12.5, 22.5]  # beyond the slack: a wake of its own, on time
    for times in written:
        gaps = [b - a for a, b in itertools.pairwise(times[:3])]
        assert all(gap <= interval + 1e-9 for gap in gaps)  # never late: silence <= interval


@on_virtual_time
async def test_a_keepalive_to_a_slow_reader_waits_in_one_task_and_the_stream_carries_on():
    release = asyncio.Event()
    reader_back = asyncio.Event()
    written: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await release.wait()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": b"data: x\n\n"})

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            if len(written) == 2:  # the reader stops reading after the first keepalive
                await reader_back.wait()
            written.append(message["body"])

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/",
        "headers": [(b"accept", b"text/event-stream")],
    }
    task = asyncio.create_task(
        Heartbeats(app, interval=TICK, commit_after=TICK)(scope, receive, send)
    )
    await asyncio.sleep(TICK * 6)  # several keepalives fall due while one is stuck
    stuck = tierchain_tasks()
    assert len(stuck) == 1
    assert not stuck[0].done()
    assert len(written) == 2
    reader_back.set()
    await asyncio.sleep(TICK * 3)
    assert len(written) >= 4  # the stuck line went out, and keepalives resumed
    release.set()
    await asyncio.wait_for(task, 1)
    assert written[-1].endswith(b"data: x\n\n")
    assert all(chunk.startswith(b': {"state":"waiting"}\n') for chunk in written[:-1])
    assert tierchain_tasks() == []


@on_virtual_time
async def test_a_caller_leaving_while_a_keepalive_is_stuck_leaves_nothing_running():
    never = asyncio.Event()
    written: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await never.wait()

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            if len(written) == 2:
                await never.wait()  # a reader that never reads again
            written.append(message["body"])

    async def receive() -> dict[str, Any]:
        await never.wait()
        return {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/",
        "headers": [(b"accept", b"text/event-stream")],
    }
    task = asyncio.create_task(
        Heartbeats(app, interval=TICK, commit_after=TICK)(scope, receive, send)
    )
    await asyncio.sleep(TICK * 4)
    assert len(tierchain_tasks()) == 1
    task.cancel()  # the server cancels the request: the stuck write goes with it
    await asyncio.wait([task])
    assert await no_tierchain_tasks_within(0.5) == []


@on_virtual_time
async def test_a_stream_the_timer_wakes_just_before_its_commit_is_due_still_commits() -> None:
    # The scheduler treats what falls due within its tolerance as due now. Streams
    # admitted together have commit times that close together, and one woken a moment
    # early used to be judged "not yet" by its write and then left out of the timer:
    # no commit and no keepalive, ever.
    from tierchain import heartbeats

    release = asyncio.Event()
    written: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await release.wait()

    async def send(message: dict[str, Any]) -> None:
        written.append(message)

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/",
        "headers": [(b"accept", b"text/event-stream")],
    }
    task = asyncio.create_task(
        Heartbeats(app, interval=10.0, commit_after=1.0)(scope, receive, send)
    )
    await asyncio.sleep(0)
    timers = deadlines._TIMERS.get()
    # The commit is timed once the request has lived its young phase (WATCH_AFTER).
    busy_for(WATCH_AFTER + deadlines.EARLY)
    timers._fire()
    (seq,) = timers.fifos[1.0].seqs
    stream = timers.pending[seq].callback.__self__  # the entry calls its stream's due()
    assert isinstance(stream, heartbeats._Stream)
    # The scheduler's wake comes half its tolerance before the commit is due.
    now = stream.started + 1.0 - deadlines.EARLY / 2
    busy_for(now - runtime_clock.now())  # the virtual clock, moved to that wake
    timers._fire()
    for _ in range(5):
        await asyncio.sleep(0)
    try:
        assert [m["type"] for m in written] == ["http.response.start", "http.response.body"]
        assert written[1]["body"] == b': {"state":"waiting"}\n'
        assert stream.entry is not None  # and it is in the timer for its first keepalive
    finally:
        release.set()
        await asyncio.wait_for(task, 1)


@on_virtual_time
async def test_a_relayed_chunk_still_in_flight_holds_the_keepalive_until_it_is_back():
    # Inside a Failover, a relayed chunk with nothing to add goes to the server without
    # a coroutine of Heartbeats' own. A slow reader holds that send for several
    # keepalive intervals: no line may be written beside it, and once it is back
    # (the backend now silent) the keepalive goes out.
    from tierchain import Backend, Failover, Routes

    reader_back = asyncio.Event()
    release = asyncio.Event()

    async def backend(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        start = {"type": "http.response.start", "status": 200}
        await send({**start, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": True})
        await release.wait()  # then silence
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    written: list[bytes] = []
    sending = 0
    overlapped = False

    async def send(message: dict[str, Any]) -> None:
        nonlocal sending, overlapped
        overlapped = overlapped or sending > 0
        sending += 1
        try:
            if message["type"] == "http.response.body":
                if message["body"] == b"data: 2\n\n":
                    await reader_back.wait()  # the slow reader
                written.append(message["body"])
        finally:
            sending -= 1

    bodies = [{"type": "http.request", "body": b'{"model": "echo", "stream": true}'}]

    async def receive() -> dict[str, Any]:
        if bodies:
            return bodies.pop()
        await asyncio.Event().wait()  # as a server does: nothing more until a disconnect
        raise AssertionError("unreachable")

    routes = Routes({"echo": [Backend("tower", "http://127.0.0.1:9")]})
    app = Heartbeats(Failover(backend, routes=routes), interval=TICK, commit_after=TICK)
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    task = asyncio.create_task(app(scope, receive, send))
    await asyncio.sleep(TICK * 4)  # several intervals pass while "data: 2" is out
    assert written[-1].endswith(b"data: 1\n\n")  # nothing went out beside it
    reader_back.set()
    await asyncio.sleep(TICK * 3)  # the backend is silent: keepalives are due
    release.set()
    await asyncio.wait_for(task, 1)
    assert not overlapped
    stream = b"".join(written)
    _, second, after = stream.partition(b"data: 2\n\n")
    assert second
    keepalives = re.findall(
        rb': \{"state":"generating","backend":"tower","idle_s":[\d.]+\}\n', after
    )
    assert len(keepalives) >= 1
    assert after == b"".join(keepalives) + b"data: [DONE]\n\n"


async def test_the_start_and_the_chunk_that_carries_state_lines_go_to_the_servers_own_send():
    # The healthy path of most requests: the inner app's start, then its first chunk with
    # the queued state lines in front. Each is handed to the server's own send coroutine
    # (no coroutine or lock of Heartbeats' own), marked as in flight for the timer.
    from tierchain import heartbeats
    from tierchain.observer import Observer

    written: list[dict[str, Any]] = []
    handed: list[Any] = []

    async def write(message: dict[str, Any]) -> None:
        written.append(message)

    def send(message: dict[str, Any]) -> Any:
        handed.append(write(message))
        return handed[-1]

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"accept", b"text/event-stream")],
    }
    stream = heartbeats._Stream(Heartbeats(lambda *_: None), scope, receive, send, True)
    stream.req.subscribe(stream.on_event)
    stream.req.emit("attempt", n=1, of=1, backend="tower")
    start = {
        "type": "http.response.start",
        "status": 200,
        "headers": [(b"content-type", b"text/event-stream")],
    }
    # Inside a Failover (as Failover leaves it at its commit): its observer has the start.
    stream.req.in_chain = True
    stream.req.observer = Observer()
    stream.req.observer.start(200, start["headers"])
    sent = stream.send(start)
    assert handed
    assert sent is handed[-1]
    assert stream.flight is sent
    await sent
    chunk = {"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True}
    sent = stream.send(chunk)
    assert handed
    assert sent is handed[-1]
    assert stream.flight is sent
    await sent
    assert [m["type"] for m in written] == ["http.response.start", "http.response.body"]
    assert written[1]["body"] == (
        b': {"state":"attempt","n":1,"of":1,"backend":"tower"}\n' + b"data: 1\n\n"
    )
    assert not stream.queue
    assert not stream.sending()
    stream.close()


@on_virtual_time
async def test_a_stream_asked_in_the_body_failover_read_past_heartbeats_is_still_committed():
    # Failover reads the body from the host's receive, past Heartbeats' own, and hands it
    # over: with no Accept header and a resolver (so Failover does not say), the body's
    # "stream": true is what Heartbeats reads, and it commits while the backend is silent.
    read: list[str] = []

    async def silent(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.sleep(2)

    failover = Failover(silent, routes=Routes({"m": [Backend("a", "http://127.0.0.1:9")]}))
    failover.resolve = lambda scope, body: "m"
    app = Heartbeats(failover, commit_after=0.5, interval=0)

    async def watched(scope: Any, receive: Any, send: Any) -> None:
        async def host_receive() -> Any:
            message = await receive()
            read.append(message["type"])
            return message

        await app(scope, host_receive, send)

    got = await one_request(watched)
    assert read[0] == "http.request"  # (the host's receive: the body, read once)
    assert got[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in got[0]["headers"]
