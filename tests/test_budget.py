"""Budget: a spent budget is a deadline (504, no failover), not a saturation."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx
import pytest

from tierchain import (
    Backend,
    BackendUnavailable,
    Budget,
    BudgetExhausted,
    Failover,
    Forwarder,
    Heartbeats,
    Routes,
    SaturationWatchdog,
    TierRequest,
    current_attempt,
)

from .support import (
    Exchange,
    FakeBackend,
    busy_for,
    chat_request,
    chat_scope,
    now,
    on_virtual_time,
    one_request,
    openai_stream,
    parse_sse,
    serve,
    streams,
)

HOSTED = openai_stream(["from ", "hosted"])


async def quiet(ex: Exchange) -> None:
    await ex.wait_closed_by_peer()


class Gateway:
    """Budget -> Failover -> SaturationWatchdog -> Forwarder."""

    def __init__(
        self, chain: list[Backend], *, slow_after: float, reserve: Any = "auto", **budget: Any
    ) -> None:
        self.forwarder = Forwarder()
        self.watchdog = SaturationWatchdog(self.forwarder, slow_after=slow_after, reserve=reserve)
        self.events: list[dict[str, Any]] = []
        inner = Budget(Failover(self.watchdog, routes=Routes({"echo": chain})), **budget)

        async def app(scope, receive, send):
            if scope["type"] == "http":
                TierRequest.of(scope).subscribe(self.events.append)
            await inner(scope, receive, send)

        self.app = app

    async def aclose(self) -> None:
        await self.forwarder.aclose()
        await self.watchdog.aclose()


async def post(url: str, body: bytes, **kw: Any) -> tuple[httpx.Response, float]:
    async with httpx.AsyncClient(timeout=5) as client:
        t0 = now()
        response = await client.post(url + "/v1/chat/completions", content=body, **kw)
        return response, now() - t0


@on_virtual_time
async def test_a_spent_budget_answers_504_and_starts_no_new_attempt(metric):
    saturated = metric("tierchain_backend_saturated_total", route="echo", backend="tower")
    exhausted = metric("tierchain_budget_exhausted_total", route="echo")
    async with FakeBackend("tower", quiet) as tower, FakeBackend("hosted") as hosted:
        # No reserve kept for hosted (reserve=0): the budget ends the tower's attempt.
        gw = Gateway(
            [Backend("tower", tower.url), Backend("hosted", hosted.url)], slow_after=0.4, reserve=0
        )
        async with serve(gw.app) as url:
            response, took = await post(url, chat_request(), headers={"x-request-timeout": "0.15"})
            await asyncio.wait_for(tower.connection_closed.wait(), 1)
        await gw.aclose()
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["type"] == "budget_exhausted"
    assert error["attempts"] == [{"backend": "tower", "outcome": "budget_exhausted"}]
    assert response.headers["x-tierchain-attempts"] == "tower;outcome=budget_exhausted"
    assert took == pytest.approx(0.15, abs=1e-6)
    assert hosted.requests == []  # no failover into a spent budget
    assert tower.open_connections == 0
    assert not [e for e in gw.events if e["state"] == "backend_saturated"]
    assert metric("tierchain_backend_saturated_total", route="echo", backend="tower") == saturated
    assert metric("tierchain_budget_exhausted_total", route="echo") == exhausted + 1


@on_virtual_time
async def test_a_slow_backend_with_budget_left_fails_over():
    async with (
        FakeBackend("tower", quiet) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        gw = Gateway([Backend("tower", tower.url), Backend("hosted", hosted.url)], slow_after=0.1)
        async with serve(gw.app) as url:
            response, took = await post(url, chat_request(), headers={"x-request-timeout": "2"})
        await gw.aclose()
    assert response.status_code == 200
    assert response.content == b"".join(HOSTED)
    assert response.headers["x-tierchain-attempts"] == (
        "tower;outcome=saturated, hosted;outcome=ok"
    )
    assert took == pytest.approx(0.1)  # slow_after, then hosted answers at once


@on_virtual_time
async def test_a_window_that_would_outlast_the_budget_is_left_to_the_budget():
    # slow_after equals the budget and no reserve is kept: the deadline wins, and it is
    # not a saturation.
    async with FakeBackend("tower", quiet) as tower, FakeBackend("hosted") as hosted:
        gw = Gateway(
            [Backend("tower", tower.url), Backend("hosted", hosted.url)],
            slow_after=0.15,
            reserve=0,
            default=0.15,
        )
        async with serve(gw.app) as url:
            response, _ = await post(url, chat_request())
        await gw.aclose()
    assert response.status_code == 504
    assert hosted.requests == []


@on_virtual_time
async def test_a_budget_spent_mid_stream_ends_it_with_an_sse_error_event():
    first, second = openai_stream(["one", "two"])[:2]

    async def stalls(ex: Exchange) -> None:
        await ex.head()
        await ex.write(first)
        await ex.write(second[:-1])  # stop in the middle of the event's blank line
        await ex.wait_closed_by_peer()

    async with FakeBackend("tower", stalls) as tower, FakeBackend("hosted") as hosted:
        gw = Gateway(
            [Backend("tower", tower.url), Backend("hosted", hosted.url)],
            slow_after=0.15,
            reserve=0,  # (with one, the stream is cut there and hosted finishes it)
        )
        async with serve(gw.app) as url:
            response, took = await post(url, chat_request(), headers={"x-request-timeout": ".25"})
        await gw.aclose()
    assert response.status_code == 200
    # The whole first event, then the error event: the half-written second one is
    # dropped, never closed off as if it were complete.
    data = response.content
    assert data.startswith(first + b'data: {"error":')
    assert b'"two"' not in data
    events = parse_sse(response.content)
    assert json.loads(events[-1]["data"])["error"]["type"] == "budget_exhausted"
    assert took == pytest.approx(0.25, abs=1e-6)
    assert hosted.requests == []


@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf", "nan", "1e3", "", "1,5"])
@on_virtual_time
async def test_a_header_that_is_not_a_finite_positive_decimal_gets_400(value):
    async with FakeBackend("tower") as tower:
        gw = Gateway([Backend("tower", tower.url)], slow_after=0)
        async with serve(gw.app) as url:
            response, _ = await post(url, chat_request(), headers={"x-request-timeout": value})
        await gw.aclose()
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "X-Request-Timeout must be a finite positive number of seconds" in message
    assert tower.requests == []


@on_virtual_time
async def test_max_clips_the_header_and_default_applies_without_one():
    seen: list[float | None] = []

    async def app(scope, receive, send):
        req = TierRequest.of(scope)
        seen.append(None if req.deadline is None else round(req.remaining() or 0, 1))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    budget = Budget(app, default=5, max=30)
    async with serve(budget) as url, httpx.AsyncClient() as client:
        await client.get(url, headers={"X-Request-Timeout": "100"})
        await client.get(url, headers={"X-Request-Timeout": "12.5"})
        await client.get(url)
    assert seen == [30.0, 12.5, 5.0]

    none = Budget(app)
    async with serve(none) as url, httpx.AsyncClient() as client:
        await client.get(url)
    assert seen[-1] is None


@on_virtual_time
async def test_budget_works_alone_in_front_of_any_app():
    async def slow_app(scope, receive, send):
        await asyncio.sleep(5)

    async with serve(Budget(slow_app, default=0.1)) as url, httpx.AsyncClient(timeout=5) as client:
        t0 = now()
        response = await client.get(url)
        took = now() - t0
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "budget_exhausted"
    assert took < 2.0


@on_virtual_time
async def test_a_budget_found_spent_between_attempts_starts_no_new_attempt():
    calls: list[str] = []

    async def blocking_handler(scope, receive, send):
        calls.append(current_attempt(scope).backend.name)
        busy_for(0.12)  # the loop is blocked: the budget's timer cannot fire meanwhile
        raise BackendUnavailable("refused", reason="connect_refused")

    app = Budget(
        Failover(
            blocking_handler,
            routes=Routes({"echo": [Backend("a", "http://a.test"), Backend("b", "http://b.test")]}),
        ),
        default=0.1,
    )
    async with serve(app) as url:
        response, _ = await post(url, chat_request())
    assert response.status_code == 504
    assert calls == ["a"]


@on_virtual_time
async def test_the_running_attempt_learns_why_it_was_cancelled():
    reasons: list[object] = []

    async def handler(scope, receive, send):
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            reasons.append(TierRequest.of(scope).cancel_reason)
            raise

    async with serve(Budget(handler, default=0.05)) as url, httpx.AsyncClient(timeout=5) as client:
        response = await client.get(url)
    assert response.status_code == 504
    assert reasons == ["budget_exhausted"]


def test_options_are_validated_in_init():
    async def app(scope, receive, send):
        pass

    with pytest.raises(ValueError, match="default"):
        Budget(app, default=0)
    with pytest.raises(ValueError, match="max"):
        Budget(app, max=float("inf"))
    with pytest.raises(ValueError, match="header"):
        Budget(app, header=" ")


@on_virtual_time
async def test_a_saturation_opens_the_breaker_but_a_spent_budget_does_not():
    from tierchain import Breaker

    async with (
        FakeBackend("tower", quiet) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        forwarder = Forwarder()
        watchdog = SaturationWatchdog(forwarder, slow_after=0.3, reserve=0)
        chain = [Backend("tower", tower.url), Backend("hosted", hosted.url)]
        app = Budget(
            Failover(Breaker(watchdog, saturation_threshold=1), routes=Routes({"echo": chain}))
        )
        async with serve(app) as url:
            # A spent budget (0.15 s, inside the window): 504, nothing charged to tower.
            spent, _ = await post(url, chat_request(), headers={"x-request-timeout": "0.15"})
            again, _ = await post(url, chat_request(), headers={"x-request-timeout": "0.15"})
            # A saturation with budget left: fails over, and the breaker opens for tower.
            saturated, _ = await post(url, chat_request())
            reached = len(tower.requests)
            skipped, took = await post(url, chat_request())
        await forwarder.aclose()
        await watchdog.aclose()
    assert spent.status_code == again.status_code == 504
    assert again.headers["x-tierchain-attempts"] == "tower;outcome=budget_exhausted"
    assert saturated.headers["x-tierchain-attempts"] == (
        "tower;outcome=saturated, hosted;outcome=ok"
    )
    assert skipped.headers["x-tierchain-attempts"] == "tower;outcome=skipped, hosted;outcome=ok"
    assert took < 0.5
    # The saturated attempt reached the tower; the skipped one sent it nothing. (The
    # two 504s may or may not have reached it within 0.15 s on a loaded machine.)
    assert reached >= 1
    assert len(tower.requests) == reached


# -- a committed stream's chunks past the Budget -------------------------------------

_EVENTS = [b'data: {"n":%d}\n\n' % i for i in range(4)] + [b"data: [DONE]\n\n"]
_SSE = (b"content-type", b"text/event-stream")


async def _streams_events(scope: Any, receive: Any, send: Any) -> None:
    await receive()  # (the whole body: one message)
    await send({"type": "http.response.start", "status": 200, "headers": [_SSE]})
    for event in _EVENTS[:-1]:
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": _EVENTS[-1]})


_ROUTES = Routes({"m": [Backend("a", "http://127.0.0.1:9")]})


@on_virtual_time
async def test_a_layer_between_budget_and_failover_still_sees_every_chunk_of_a_committed_stream():
    # Failover may hand mid-stream chunks past a Budget that only passes them on; a layer
    # of the user's in between must not be skipped with it.
    seen: list[bytes] = []

    def marks(app: Any) -> Any:
        async def middleware(scope: Any, receive: Any, send: Any) -> None:
            async def marked(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.body":
                    seen.append(message["body"])
                    message = {**message, "body": message["body"].replace(b"data:", b"data: ")}
                await send(message)

            await app(scope, receive, marked)

        return middleware

    got = await one_request(Budget(marks(Failover(_streams_events, routes=_ROUTES)), default=60))
    bodies = [m["body"] for m in got if m["type"] == "http.response.body"]
    assert seen == _EVENTS
    assert b"".join(bodies) == b"".join(_EVENTS).replace(b"data:", b"data: ")
    assert not got[-1].get("more_body", False)


@on_virtual_time
async def test_a_stream_through_budget_and_failover_reaches_the_caller_whole_and_ends_marked():
    scope = chat_scope()
    got = await one_request(Budget(Failover(_streams_events, routes=_ROUTES), default=60), scope)
    bodies = [m["body"] for m in got if m["type"] == "http.response.body"]
    assert b"".join(bodies) == b"".join(_EVENTS)
    assert [m.get("more_body", False) for m in got[1:]] == [True] * 4 + [False]
    # The request's state lets go of the layers' sends once it is over (no cycle left).
    assert TierRequest.of(scope).body_pass is None


@on_virtual_time
async def test_two_budgets_around_a_failover_both_see_the_stream_end():
    # The outer budget is the tighter one; both see the end, so neither fires after it.
    inner = Budget(Failover(_streams_events, routes=_ROUTES), default=60)
    got = await one_request(Budget(inner, default=30))
    assert b"".join(m["body"] for m in got if m["type"] == "http.response.body") == b"".join(
        _EVENTS
    )
    await asyncio.sleep(120)  # (virtual) past both budgets: nothing more is sent
    assert not got[-1].get("more_body", False)
    assert len(got) == 1 + len(_EVENTS)


def _spent(caplog: pytest.LogCaptureFixture) -> Any:
    (spent,) = [r for r in caplog.records if getattr(r, "event", "") == "request.budget_exhausted"]
    return spent.tierchain


@on_virtual_time
async def test_budget_notes_the_start_failover_sends_past_it(caplog):
    # Failover holding Budget's own send sends the start past it and notes it for Budget:
    # the budget spent mid-stream ends the stream with an error event, never a 504.
    async def stalls(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [_SSE]})
        await send({"type": "http.response.body", "body": _EVENTS[0], "more_body": True})
        await asyncio.sleep(3600)

    got = await one_request(Budget(Failover(stalls, routes=_ROUTES), default=2))
    assert [m["status"] for m in got if m["type"] == "http.response.start"] == [200]
    assert b"budget_exhausted" in got[-1]["body"]
    assert not got[-1]["more_body"]
    assert _spent(caplog)["started"] is True


@on_virtual_time
async def test_budget_knows_the_start_a_layer_between_it_and_failover_sent_first(caplog):
    # Heartbeats between the two commits its own stream while the backend is silent: that
    # start went through Budget, which knows the response started though Failover never
    # committed, and sends no second start (no 504) when the budget is spent.
    async def silent(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await asyncio.sleep(3600)

    app = Budget(Heartbeats(Failover(silent, routes=_ROUTES), commit_after=0.5), default=2)

    async def answered(scope: Any, receive: Any, send: Any) -> None:
        with contextlib.suppress(BudgetExhausted):  # (nothing of the answer to end it with)
            await app(scope, receive, send)

    got = await one_request(answered)
    assert [m["status"] for m in got if m["type"] == "http.response.start"] == [200]
    assert _spent(caplog)["started"] is True
