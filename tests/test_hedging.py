"""Hedge when in doubt: a quiet local tier is joined by the next one; the first to produce
data wins, the other is cancelled and never counted as a failure.

Over real sockets: a uvicorn gateway (Heartbeats, Budget, Failover, Breaker,
SaturationWatchdog, Forwarder, as the README stacks them), fake upstreams on loopback that
speak OpenAI chat (tests/support.py: the chat.completion and chat.completion.chunk objects of
the OpenAI API reference) and Anthropic Messages (tests/wire_fakes.py: its streaming events
as Anthropic documents them) byte for byte. Time is virtual
(:func:`tierchain.testing.virtual_time`): ``hedge_after`` and the fakes' delays cost no
wall clock, and the order of events is exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tierchain import (
    Backend,
    Breaker,
    Budget,
    Failover,
    Forwarder,
    Heartbeats,
    MemoryStore,
    Routes,
    SaturationWatchdog,
    current_attempt,
)
from tierchain.config import from_env
from tierchain.failover.hedging import hedged_by_default
from tierchain.stack import build_stack
from tierchain.telemetry import HEDGES

from .support import (
    Exchange,
    FakeBackend,
    Recorder,
    Script,
    completion_body,
    now,
    on_virtual_time,
    openai_stream,
    serve,
)
from .wire_fakes import anthropic_stream

HOSTED = openai_stream(["from ", "hosted"], model="hosted-model")
TOWER = openai_stream(["from ", "tower"], model="tower-model")


def quiet(closed: asyncio.Event) -> Script:
    """A tower that accepts, pings, and never sends a data event (until the gateway hangs up)."""

    async def script(ex: Exchange) -> None:
        await ex.head()
        await ex.write(b": ping\n\n")
        await ex.wait_closed_by_peer()
        closed.set()
        ex.finished = True

    return script


def later(events: list[bytes], after: float, closed: asyncio.Event | None = None) -> Script:
    """A stream whose first data event comes ``after`` (virtual) seconds in; set ``closed``
    when the gateway hangs up on it before it is done."""

    async def script(ex: Exchange) -> None:
        await ex.head()
        await ex.write(b": ping\n\n")
        try:
            await asyncio.sleep(after)
            for event in events:
                await ex.write(event)
            await ex.end()
        except (ConnectionError, asyncio.CancelledError):
            if closed is not None:
                closed.set()
            raise
        if closed is not None and ex.finished is False:
            closed.set()

    return script


def cut_watch(closed: asyncio.Event) -> Script:
    """A hosted tier that sends its head at once and its first data event only after 30 s,
    noting when the gateway closes its connection first."""

    async def script(ex: Exchange) -> None:
        await ex.head()
        await ex.write(b": ping\n\n")
        sleeper = asyncio.ensure_future(asyncio.sleep(30))
        closer = asyncio.ensure_future(ex.wait_closed_by_peer())
        done, _ = await asyncio.wait([sleeper, closer], return_when=asyncio.FIRST_COMPLETED)
        for task in (sleeper, closer):
            task.cancel()
        await asyncio.gather(sleeper, closer, return_exceptions=True)
        if closer in done:
            closed.set()
            ex.finished = True
            return
        for event in HOSTED:
            await ex.write(event)
        await ex.end()

    return script


def fails(ex: Exchange) -> Any:
    return ex.respond(500, b'{"error":{"message":"boom"}}')


def hedges(route: str, backend: str, winner: str) -> float:
    value: float = HEDGES.labels(route, backend, winner)._value.get()
    return value


@contextlib.asynccontextmanager
async def gateway(
    first: Script,
    second: Script,
    *,
    hedge_after: float | None = 5.0,
    budget: float | None = 170.0,
    tower_status: str | None = None,
    failure_threshold: int = 1,
    saturation_threshold: int = 1,
    watchdog: bool = True,
) -> AsyncIterator[tuple[str, FakeBackend, FakeBackend, Recorder, MemoryStore]]:
    async with FakeBackend("tower", first) as t, FakeBackend("hosted", second) as h:
        routes = Routes(
            {
                "echo": [
                    Backend(name="tower", url=t.url, status_url=tower_status),
                    Backend(name="hosted", url=h.url, regime="hosted"),
                ]
            }
        )
        store = MemoryStore()
        forwarder = Forwarder(connect_timeout=2.0)
        inner: Any = (
            # Every caller hedged on its own: no suspect mark skips the tower for the next.
            SaturationWatchdog(forwarder, slow_after=60.0, suspect_for=0) if watchdog else forwarder
        )
        inner = Breaker(
            inner,
            store=store,
            failure_threshold=failure_threshold,
            saturation_threshold=saturation_threshold,
        )
        app: Any = Failover(inner, routes=routes, paths=("/v1/",), hedge_after=hedge_after)
        app = Budget(app, default=budget)
        recorder = Recorder(Heartbeats(app, interval=10.0))
        try:
            async with serve(recorder, lifespan="on") as url:
                yield url, t, h, recorder, store
        finally:
            await forwarder.aclose()


async def chat(url: str, *, stream: bool = True) -> httpx.Response:
    body = {"model": "echo", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(timeout=300) as client:
        return await client.post(url + "/v1/chat/completions", json=body)


def trail(recorder: Recorder, i: int = 0) -> list[tuple[str, str]]:
    """The i-th request's attempt records: (backend, outcome), in the order they ended."""
    return [(r.backend, r.outcome) for r in recorder.requests[i].attempts]


def states(recorder: Recorder, name: str) -> list[dict[str, Any]]:
    return [e for e in recorder.events if e["state"] == name]


def data_of(content: bytes) -> bytes:
    """The response's upstream bytes: its state lines (comments) left out."""
    lines = [line for line in content.split(b"\n") if not line.startswith(b":")]
    return b"\n".join(lines).replace(b"\n\n\n", b"\n\n").lstrip(b"\n")


# -- off by default ----------------------------------------------------------------------


@on_virtual_time
async def test_no_hedge_by_default_the_next_tier_gets_nothing_while_the_first_is_quiet() -> None:
    async with gateway(later(TOWER, 8.0), later(HOSTED, 0.0), hedge_after=None) as (
        url,
        tower,
        hosted,
        recorder,
        _,
    ):
        got = await chat(url)
    assert got.status_code == 200
    assert data_of(got.content) == b"".join(TOWER)
    assert len(tower.requests) == 1
    assert hosted.requests == []
    assert states(recorder, "hedging") == []


def test_failover_has_no_hedging_unless_hedge_after_is_set() -> None:
    routes = Routes({"echo": [Backend("tower", "http://127.0.0.1:9")]})
    assert Failover(Forwarder(), routes=routes).hedging is None
    assert Failover(Forwarder(), routes=routes, hedge_after=0).hedging is None
    assert Failover(Forwarder(), routes=routes, hedge_after=5).hedging is not None


def test_local_backends_are_hedged_by_default_and_hosted_ones_only_when_marked() -> None:
    assert hedged_by_default(Backend("a", "http://127.0.0.1:8080"))
    assert hedged_by_default(Backend("b", "http://192.168.1.20:11434"))
    assert hedged_by_default(Backend("c", "http://localhost:8080"))
    assert hedged_by_default(Backend("d", "https://gpu.example.com", regime="local"))
    assert not hedged_by_default(Backend("e", "https://api.example.com"))
    # A declared regime wins over the address: hosted on a private address is not hedged.
    assert not hedged_by_default(Backend("f", "http://10.0.0.7:8000", regime="hosted"))
    assert not hedged_by_default(Backend("g", "http://127.0.0.1:8000", regime="hosted"))
    policy = Failover(Forwarder(), routes={"x": [Backend("z", "http://1.1.1.1")]}, hedge_after=5)
    assert policy.hedging is not None
    assert policy.hedging.may_hedge(Backend("h", "https://api.example.com", hedge=True))
    assert not policy.hedging.may_hedge(Backend("l", "http://127.0.0.1:1", hedge=False))
    assert policy.hedging.may_hedge(Backend("p", "http://10.0.0.8", regime="hosted", hedge=True))
    assert not policy.hedging.may_hedge(Backend("v", "http://10.0.0.9", regime="hosted"))


# -- a quiet first tier: the hedge wins --------------------------------------------------


@on_virtual_time
async def test_a_quiet_tower_is_hedged_after_hedge_after_and_the_hedge_answers_byte_for_byte() -> (
    None
):
    closed = asyncio.Event()
    before = hedges("echo", "tower", "hedge")
    async with gateway(quiet(closed), later(HOSTED, 0.5)) as (url, tower, hosted, recorder, _):
        loop = asyncio.get_running_loop()
        start = loop.time()
        got = await chat(url)
        took = loop.time() - start
        await asyncio.wait_for(closed.wait(), 5)  # the tower's upstream connection was closed
    assert got.status_code == 200
    assert data_of(got.content) == b"".join(HOSTED)
    assert 5.0 <= took < 6.0  # hedge_after, then hosted's own half second
    assert len(tower.requests) == 1
    assert len(hosted.requests) == 1
    assert json.loads(hosted.requests[0].body) == json.loads(tower.requests[0].body)
    assert states(recorder, "hedging") == [
        {"state": "hedging", "backend": "tower", "with": "hosted", "after_s": 5.0}
    ]
    # Heartbeats committed the stream early: the trail is the request's records.
    assert trail(recorder) == [("tower", "hedge_lost"), ("hosted", "ok")]
    assert b': {"state":"generating","backend":"hosted"}' in got.content
    assert hedges("echo", "tower", "hedge") == before + 1
    # The state line reached the caller as an SSE comment before the answer.
    assert b': {"state":"hedging","backend":"tower","with":"hosted","after_s":5.0}' in got.content


@on_virtual_time
async def test_a_first_tier_that_loses_the_hedge_is_charged_no_failure() -> None:
    closed = asyncio.Event()
    async with gateway(
        quiet(closed), later(HOSTED, 0.5), failure_threshold=1, saturation_threshold=2
    ) as (url, tower, _, recorder, _store):
        first = await chat(url)
        assert first.status_code == 200
        tower.script = later(TOWER, 0.1)
        second = await chat(url)
    # With one failure charged (threshold 1), its breaker would be open and skip it.
    assert second.status_code == 200
    assert data_of(second.content) == b"".join(TOWER)
    assert len(tower.requests) == 2
    assert trail(recorder, 1) == [("tower", "ok")]
    assert states(recorder, "backend_skipped") == []


@on_virtual_time
async def test_a_tower_that_keeps_losing_the_hedge_is_skipped_for_saturation() -> None:
    """Losing the race is a saturation (no first token in hedge_after plus the hedge's own
    time): past the breaker's saturation threshold the callers after it are sent to the
    next tier at once, with no 5 s wait each (issue 32: the third caller skipped)."""
    closed = asyncio.Event()
    async with gateway(
        quiet(closed), later(HOSTED, 0.5), failure_threshold=5, saturation_threshold=2
    ) as (url, tower, _, recorder, _store):
        for _ in range(2):
            assert (await chat(url)).status_code == 200
        started = now()
        third = await chat(url)
        took = now() - started
    assert data_of(third.content) == b"".join(HOSTED)
    assert len(tower.requests) == 2  # the third never reached the tower
    assert trail(recorder, 2) == [("tower", "skipped"), ("hosted", "ok")]
    assert took < 5.0  # no hedge_after wait: skipped before sending
    assert trail(recorder, 0) == [("tower", "hedge_lost"), ("hosted", "ok")]


@on_virtual_time
async def test_a_non_streaming_answer_of_the_hedge_wins_whole() -> None:
    closed = asyncio.Event()
    hosted_body = completion_body("from hosted", model="hosted-model")

    async def whole(ex: Exchange) -> None:
        await asyncio.sleep(0.5)
        await ex.respond(200, hosted_body)

    async def quiet_json(ex: Exchange) -> None:
        await ex.wait_closed_by_peer()
        closed.set()
        ex.finished = True

    before = hedges("echo", "tower", "hedge")
    async with gateway(quiet_json, whole) as (url, _, _hosted, recorder, _s):
        got = await chat(url, stream=False)
        await asyncio.wait_for(closed.wait(), 5)
    assert got.status_code == 200
    assert got.content == hosted_body
    assert got.headers["x-tierchain-attempts"] == "tower;outcome=hedge_lost, hosted;outcome=ok"
    assert len(states(recorder, "hedging")) == 1
    assert hedges("echo", "tower", "hedge") == before + 1


@on_virtual_time
async def test_an_anthropic_stream_of_the_hedge_reaches_the_caller_whole() -> None:
    closed = asyncio.Event()
    events = anthropic_stream(["from ", "hosted"], model="hosted-model")

    async def hosted_script(ex: Exchange) -> None:
        await ex.head()
        await asyncio.sleep(0.5)
        for event in events:
            await ex.write(event)
        await ex.end()

    body = {
        "model": "echo",
        "max_tokens": 64,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    async with gateway(quiet(closed), hosted_script) as (url, _, hosted, recorder, _s):
        async with httpx.AsyncClient(timeout=300) as client:
            got = await client.post(url + "/v1/messages", json=body)
        await asyncio.wait_for(closed.wait(), 5)
    assert got.status_code == 200
    assert data_of(got.content) == b"".join(events)
    assert hosted.requests[0].path == "/v1/messages"
    assert len(states(recorder, "hedging")) == 1


# -- the first tier answers first: the hedge is cancelled --------------------------------


@on_virtual_time
async def test_the_first_tier_answering_before_the_hedge_wins_and_the_hedge_is_cancelled() -> None:
    hedge_closed = asyncio.Event()
    before = hedges("echo", "tower", "first")
    async with gateway(later(TOWER, 7.0), cut_watch(hedge_closed), failure_threshold=1) as (
        url,
        tower,
        hosted,
        recorder,
        _,
    ):
        got = await chat(url)
        await asyncio.wait_for(hedge_closed.wait(), 5)  # hosted's connection was closed
        assert got.status_code == 200
        assert data_of(got.content) == b"".join(TOWER)
        assert trail(recorder) == [("hosted", "hedge_lost"), ("tower", "ok")]
        assert len(hosted.requests) == 1
        assert len(states(recorder, "hedging")) == 1
        assert hedges("echo", "tower", "first") == before + 1
        # hosted was not charged: with one failure counted it would be skipped now.
        tower.script = fails
        hosted.script = later(HOSTED, 0.0)
        again = await chat(url)
    assert again.status_code == 200
    assert data_of(again.content) == b"".join(HOSTED)


@on_virtual_time
async def test_an_answer_before_hedge_after_starts_no_hedge() -> None:
    async with gateway(later(TOWER, 2.0), later(HOSTED, 0.0)) as (url, _, hosted, recorder, _s):
        got = await chat(url)
    assert got.status_code == 200
    assert hosted.requests == []
    assert states(recorder, "hedging") == []


# -- no hedge: a firm verdict, too little budget -----------------------------------------


@on_virtual_time
async def test_a_busy_status_fails_over_as_before_and_does_not_hedge() -> None:
    async def slots(ex: Exchange) -> None:
        # llama.cpp's /slots (tools/server README): the one slot is processing a prompt.
        body = json.dumps([{"id": 0, "is_processing": True, "n_ctx": 4096}]).encode()
        await ex.respond(200, body)

    async with (
        FakeBackend("status", slots) as status,
        gateway(later(TOWER, 0.0), later(HOSTED, 0.0), tower_status=status.url + "/slots") as (
            url,
            tower,
            hosted,
            recorder,
            _,
        ),
    ):
        got = await chat(url)
    assert got.status_code == 200
    assert data_of(got.content) == b"".join(HOSTED)
    assert tower.requests == []  # skipped before sending: busy, no hedge
    assert len(hosted.requests) == 1
    assert states(recorder, "hedging") == []
    assert states(recorder, "backend_busy")


@on_virtual_time
async def test_no_hedge_when_the_budget_left_is_too_short(caplog: pytest.LogCaptureFixture) -> None:
    # Without a watchdog no reserve is kept: at hedge_after (5 s) only 0.5 s of the 5.5 s
    # budget is left, under the 1 s a hedge needs at least. (With a watchdog the reserve
    # cuts the first tier before that, and the chain fails over as before.)
    caplog.set_level("INFO", logger="tierchain")
    closed = asyncio.Event()
    async with gateway(quiet(closed), later(HOSTED, 0.0), budget=5.5, watchdog=False) as (
        url,
        _,
        hosted,
        recorder,
        _s,
    ):
        got = await chat(url, stream=False)
    assert got.status_code == 504
    assert hosted.requests == []
    assert states(recorder, "hedging") == []
    skipped = [r.getMessage() for r in caplog.records if "dispatch.hedge_skipped" in r.getMessage()]
    assert len(skipped) == 1
    assert 'reason="budget"' in skipped[0]


# -- both fail -----------------------------------------------------------------------------


@on_virtual_time
async def test_when_both_fail_the_caller_gets_the_usual_error_after_both_are_out() -> None:
    async def late_failure(ex: Exchange) -> None:
        await asyncio.sleep(8.0)
        await ex.respond(500, b'{"error":{"message":"tower down"}}')

    async def hosted_failure(ex: Exchange) -> None:
        await asyncio.sleep(1.0)
        await ex.respond(500, b'{"error":{"message":"hosted down"}}')

    before = hedges("echo", "tower", "none")
    async with gateway(late_failure, hosted_failure, failure_threshold=5) as (
        url,
        tower,
        hosted,
        recorder,
        _,
    ):
        loop = asyncio.get_running_loop()
        start = loop.time()
        got = await chat(url, stream=False)
        took = loop.time() - start
    assert got.status_code == 502
    assert got.json()["error"]["type"] == "all_backends_failed"
    assert took >= 8.0  # the tower, still running after the hedge failed, was waited for
    outcomes = [(a["backend"], a["outcome"]) for a in got.json()["error"]["attempts"]]
    assert ("tower", "http_500") in outcomes
    assert ("hosted", "http_500") in outcomes
    assert len(hosted.requests) == 1
    assert len(tower.requests) == 1
    assert hedges("echo", "tower", "none") == before + 1
    assert len(states(recorder, "hedging")) == 1


# -- tierchain serve: on for a local tier ------------------------------------------------


@on_virtual_time
async def test_serve_hedges_a_quiet_local_tower_after_5_s_and_not_a_tier_marked_false(
    tmp_path: Path,
) -> None:
    closed = asyncio.Event()
    async with (
        FakeBackend("tower", quiet(closed)) as t,
        FakeBackend("hosted", later(HOSTED, 0.5)) as h,
    ):
        file = tmp_path / "routes.toml"
        file.write_text(
            f'[[routes.echo.backends]]\nname = "tower"\nurl = "{t.url}"\n'
            f'[[routes.echo.backends]]\nname = "hosted"\nurl = "{h.url}"\n'
        )
        settings = from_env({"TIERCHAIN_ROUTES_FILE": str(file)})
        assert settings.layers["Failover"].options["hedge_after"] == 5.0
        recorder = Recorder(build_stack(None, settings, identity=False))
        async with serve(recorder, lifespan="on") as url:
            loop = asyncio.get_running_loop()
            start = loop.time()
            got = await chat(url)
            took = loop.time() - start
            await asyncio.wait_for(closed.wait(), 5)
        assert got.status_code == 200
        assert data_of(got.content) == b"".join(HOSTED)
        assert 5.0 <= took < 6.0
        assert states(recorder, "hedging") == [
            {"state": "hedging", "backend": "tower", "with": "hosted", "after_s": 5.0}
        ]
        # Marked hedge = false: the same quiet tower is not hedged (the watchdog's own
        # window fails it over later, as before).
        file.write_text(
            f'[[routes.echo.backends]]\nname = "tower"\nurl = "{t.url}"\nhedge = false\n'
            f'[[routes.echo.backends]]\nname = "hosted"\nurl = "{h.url}"\n'
        )
        settings = from_env({"TIERCHAIN_ROUTES_FILE": str(file)})
        recorder = Recorder(build_stack(None, settings, identity=False))
        async with serve(recorder, lifespan="on") as url:
            start = loop.time()
            got = await chat(url)
            took = loop.time() - start
        assert got.status_code == 200
        assert data_of(got.content) == b"".join(HOSTED)
        assert took > 6.0
        assert states(recorder, "hedging") == []


@on_virtual_time
async def test_the_attempt_spans_and_the_log_say_which_tier_hedged_which(monkeypatch, caplog):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tierchain import telemetry

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    monkeypatch.setattr(telemetry, "tracer", provider.get_tracer("tierchain"))
    caplog.set_level("INFO", logger="tierchain")
    closed = asyncio.Event()
    try:
        async with gateway(quiet(closed), later(HOSTED, 0.5)) as (url, *_):
            got = await chat(url)
            await asyncio.wait_for(closed.wait(), 5)
    finally:
        provider.shutdown()
    assert got.status_code == 200
    attempts = [s for s in exporter.get_finished_spans() if s.name == "tierchain.attempt"]
    by_backend = {s.attributes["tierchain.backend"]: s.attributes for s in attempts}
    assert by_backend["tower"]["tierchain.outcome"] == "hedge_lost"
    assert by_backend["tower"]["tierchain.hedge.with"] == "hosted"
    assert by_backend["hosted"]["tierchain.outcome"] == "ok"
    assert by_backend["hosted"]["tierchain.hedge.for"] == "tower"
    events = [r.getMessage().split()[0] for r in caplog.records if r.name == "tierchain"]
    assert "dispatch.hedging" in events
    assert "dispatch.hedged" in events
    assert "dispatch.attempt_failed" not in events  # the loser is no failure


# -- the request ends while both run ---------------------------------------------------


@on_virtual_time
async def test_a_caller_leaving_while_both_run_closes_both_upstream_connections() -> None:
    tower_closed, hosted_closed = asyncio.Event(), asyncio.Event()
    body = {"model": "echo", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with gateway(quiet(tower_closed), quiet(hosted_closed)) as (url, _, hosted, rec, _s):
        async with (
            httpx.AsyncClient(timeout=300) as client,
            client.stream("POST", url + "/v1/chat/completions", json=body) as got,
        ):
            async for line in got.aiter_lines():
                if '"state":"attempt","n":2' in line:
                    break  # the hedge has started: leave
        await asyncio.wait_for(tower_closed.wait(), 5)
        await asyncio.wait_for(hosted_closed.wait(), 5)
    assert len(hosted.requests) == 1
    assert sorted(r.outcome for r in rec.requests[0].attempts) == ["cancelled", "cancelled"]


@on_virtual_time
async def test_a_budget_spent_while_both_run_answers_504_and_cancels_both() -> None:
    tower_closed, hosted_closed = asyncio.Event(), asyncio.Event()
    async with gateway(quiet(tower_closed), quiet(hosted_closed), budget=8.0, watchdog=False) as (
        url,
        _,
        hosted,
        rec,
        _s,
    ):
        got = await chat(url, stream=False)
        await asyncio.wait_for(tower_closed.wait(), 5)
        await asyncio.wait_for(hosted_closed.wait(), 5)
    assert got.status_code == 504
    assert len(hosted.requests) == 1
    assert len(states(rec, "hedging")) == 1
    outcomes = sorted(r.outcome for r in rec.requests[0].attempts)
    assert outcomes == ["budget_exhausted", "budget_exhausted"]


# -- the watchdog's verdict: only doubt hedges -------------------------------------------


@pytest.mark.parametrize(
    ("verdict", "hedged"),
    [("working", True), ("unknown", True), ("too_slow", False), ("no_progress", False)],
)
@on_virtual_time
async def test_only_a_verdict_in_doubt_is_hedged(verdict: str, hedged: bool) -> None:
    # The watchdog leaves its latest word on the attempt (Attempt.verdict); here a layer in
    # its place leaves it at once, so that the word is there when hedge_after falls due.
    closed = asyncio.Event()
    async with (
        FakeBackend("tower", quiet(closed)) as t,
        FakeBackend("hosted", later(HOSTED, 0.5)) as h,
    ):
        routes = Routes({"echo": [Backend("tower", t.url), Backend("hosted", h.url)]})
        forwarder = Forwarder(connect_timeout=2.0)

        async def says(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                attempt = current_attempt(scope)
                if attempt.backend.name == "tower":
                    attempt.verdict = verdict
            await forwarder(scope, receive, send)

        app = Budget(Failover(says, routes=routes, paths=("/v1/",), hedge_after=5.0), default=20)
        recorder = Recorder(app)
        try:
            async with serve(recorder, lifespan="on") as url:
                got = await chat(url, stream=False)
        finally:
            await forwarder.aclose()
    assert (len(states(recorder, "hedging")) == 1) is hedged
    assert got.status_code == (200 if hedged else 504)


@on_virtual_time
async def test_after_both_fail_the_chain_goes_on_past_the_hedged_tier() -> None:
    async def late_failure(ex: Exchange) -> None:
        await asyncio.sleep(8.0)
        await ex.respond(500, b'{"error":{"message":"tower down"}}')

    async def mid_failure(ex: Exchange) -> None:
        await asyncio.sleep(1.0)
        await ex.respond(503, b'{"error":{"message":"mid down"}}')

    hosted_body = completion_body("from hosted", model="hosted-model")

    async def answers_whole(ex: Exchange) -> None:
        await ex.respond(200, hosted_body)

    async with (
        FakeBackend("tower", late_failure) as t,
        FakeBackend("mid", mid_failure) as m,
        FakeBackend("hosted", answers_whole) as h,
    ):
        routes = Routes(
            {
                "echo": [
                    Backend("tower", t.url),
                    Backend("mid", m.url, hedge=False),
                    Backend("hosted", h.url),
                ]
            }
        )
        forwarder = Forwarder(connect_timeout=2.0)
        breaker = Breaker(SaturationWatchdog(forwarder, slow_after=60.0), store=MemoryStore())
        app = Budget(Failover(breaker, routes=routes, paths=("/v1/",), hedge_after=5.0), default=60)
        recorder = Recorder(app)
        try:
            async with serve(recorder, lifespan="on") as url:
                got = await chat(url, stream=False)
        finally:
            await forwarder.aclose()
    assert got.status_code == 200
    assert got.content == hosted_body
    # mid (the hedge) failed at 6 s, the tower at 8 s: only then the chain went on, to hosted
    # (neither was tried a second time).
    assert got.headers["x-tierchain-attempts"] == (
        "mid;outcome=http_503, tower;outcome=http_500, hosted;outcome=ok"
    )
    assert (len(t.requests), len(m.requests), len(h.requests)) == (1, 1, 1)
    assert states(recorder, "hedging") == [
        {"state": "hedging", "backend": "tower", "with": "mid", "after_s": 5.0}
    ]


@on_virtual_time
async def test_a_hedge_gives_its_in_flight_lease_back_so_the_next_caller_hedges_again() -> None:
    # mid takes one attempt at a time and is not the last tier: had the first hedge kept
    # its lease, the second caller's hedge would find mid full (busy) and not answer.
    closed = asyncio.Event()
    async with (
        FakeBackend("tower", quiet(closed)) as t,
        FakeBackend("mid", later(HOSTED, 0.5)) as m,
        FakeBackend("hosted", later(HOSTED, 0.0)) as h,
    ):
        routes = Routes(
            {
                "echo": [
                    Backend("tower", t.url),
                    Backend("mid", m.url, regime="hosted", max_in_flight=1),
                    Backend("hosted", h.url, regime="hosted"),
                ]
            }
        )
        forwarder = Forwarder(connect_timeout=2.0)
        failover = Failover(forwarder, routes=routes, paths=("/v1/",), hedge_after=5.0)
        recorder = Recorder(Budget(failover, default=60))
        try:
            async with serve(recorder, lifespan="on") as url:
                first = await chat(url)
                second = await chat(url)
                live = await failover.admission.store.lease_count("mid")
        finally:
            await forwarder.aclose()
    for got in (first, second):
        assert got.status_code == 200
        assert data_of(got.content) == b"".join(HOSTED)
        assert got.headers["x-tierchain-backend"] == "mid"
    assert [trail(recorder, i) for i in (0, 1)] == [[("tower", "hedge_lost"), ("mid", "ok")]] * 2
    assert (len(m.requests), len(h.requests)) == (2, 0)
    assert live == 0
