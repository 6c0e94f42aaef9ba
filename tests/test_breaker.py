"""Breaker: two ledgers, skipping an open backend, single-flight recovery, alone or chained."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from typing import Any

import httpx
import pytest

from tierchain import (
    Backend,
    BackendSaturated,
    BackendUnavailable,
    Breaker,
    Failover,
    Forwarder,
    MemoryStore,
    Routes,
    TierRequest,
    current_attempt,
)
from tierchain.errors import BudgetExhausted

from .support import (
    FakeBackend,
    SaturateAfter,
    answers,
    chat_request,
    fresh_post,
    now,
    on_virtual_time,
    serve,
    streams,
)

TOWER = Backend("tower", "http://tower.invalid")
HOSTED = Backend("hosted", "http://hosted.invalid")
ROUTES = Routes({"echo": [TOWER, HOSTED]})


class Tiers:
    """An inner app standing in for the backends: each name answers per its mode.

    Modes: ``"ok"`` (an SSE stream), ``"unavailable"``, ``"saturated"``,
    ``"hang"`` (waits for ``release``, then streams), or an HTTP status.
    """

    def __init__(self, **modes: Any) -> None:
        self.modes = modes
        self.calls: Counter[str] = Counter()
        self.release = asyncio.Event()
        self.entered = asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        name = current_attempt(scope).backend.name
        self.calls[name] += 1
        mode = self.modes.get(name, "ok")
        if mode == "hang":
            self.entered.set()
            await self.release.wait()
            mode = "ok"
        if mode == "unavailable":
            raise BackendUnavailable("refused", reason="connect_refused")
        if mode == "saturated":
            raise BackendSaturated("no first chunk", waited=0.2)
        if isinstance(mode, tuple):
            status, headers = mode
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        if isinstance(mode, int):
            await send({"type": "http.response.start", "status": mode, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": b": ping\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


class Result:
    def __init__(self, messages: list[dict[str, Any]], events: list[dict[str, Any]]) -> None:
        start = next(m for m in messages if m["type"] == "http.response.start")
        self.status = start["status"]
        self.headers = {k.decode(): v.decode() for k, v in start.get("headers", [])}
        self.body = b"".join(m.get("body", b"") for m in messages if "body" in m)
        self.events = events

    def json(self) -> Any:
        return json.loads(self.body)

    def states(self, state: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["state"] == state]


async def call(app, *, leave: asyncio.Event | None = None, model: str = "echo") -> Result:
    """One in-process request through ``app``; ``leave`` set means the caller left."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "headers": [(b"content-type", b"application/json")],
        "query_string": b"",
    }
    events: list[dict[str, Any]] = []
    TierRequest.of(scope).subscribe(events.append)
    first = True
    gone = leave or asyncio.Event()

    async def receive():
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": chat_request(model), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    messages: list[dict[str, Any]] = []

    async def send(message):
        messages.append(message)

    await app(scope, receive, send)
    return Result(messages, events)


def chain(tiers, store=None, **opts) -> Failover:
    return Failover(Breaker(tiers, store=store, **opts), routes=ROUTES)


async def test_five_failures_open_the_breaker_and_the_backend_is_skipped_untouched():
    tiers = Tiers(tower="unavailable")
    app = chain(tiers)
    for _ in range(5):
        result = await call(app)
        assert result.headers["x-tierchain-attempts"].startswith("tower;outcome=connect_refused")
    result = await call(app)
    assert result.status == 200
    assert tiers.calls["tower"] == 5
    assert result.headers["x-tierchain-attempts"] == "tower;outcome=skipped, hosted;outcome=ok"
    (skipped,) = result.states("backend_skipped")
    assert skipped["backend"] == "tower"
    assert skipped["failing_over"] is True
    # The first open for failures lasts probe_every (2 s): the recovery probe comes soon.
    assert 1.0 < skipped["retry_in_s"] <= 2.0


async def test_a_same_tier_retry_that_fails_is_one_failure_not_two(manual_clock):
    """Failover's retries=1 tries a 500 twice per request: the breaker counts the request's
    bad luck once, so it opens after five failing requests, not three."""
    store = MemoryStore(clock=manual_clock)
    tiers = Tiers(tower=500)
    app = chain(tiers, store)
    for _ in range(4):
        result = await call(app)
        assert result.headers["x-tierchain-backend"] == "hosted"
    assert tiers.calls["tower"] == 8  # every request tried the tower twice
    snap = await store.breaker_snapshot("echo", "tower")
    assert (snap.state, snap.failures) == ("closed", 4)
    await call(app)
    assert (await store.breaker_snapshot("echo", "tower")).state == "open"
    await call(app)
    assert tiers.calls["tower"] == 9  # the fifth request's first try opened it


async def test_5xx_and_429_count_as_failures(manual_clock):
    store = MemoryStore(clock=manual_clock)
    tiers = Tiers(tower=500)
    app = chain(tiers, store, failure_threshold=2)
    await call(app)
    tiers.modes["tower"] = 429
    await call(app)
    snap = await store.breaker_snapshot("echo", "tower")
    assert (snap.state, snap.failures) == ("open", 2)


async def test_a_4xx_other_than_429_never_counts_and_clears_nothing():
    store = MemoryStore()
    tiers = Tiers(tower="unavailable")
    app = chain(tiers, store)
    for _ in range(4):
        await call(app)
    tiers.modes["tower"] = 400
    for _ in range(10):
        result = await call(app)
        assert result.status == 400
    snap = await store.breaker_snapshot("echo", "tower")
    assert (snap.state, snap.failures) == ("closed", 4)


async def test_two_saturations_open_for_fifteen_minutes_apart_from_failures(manual_clock):
    store = MemoryStore(clock=manual_clock)
    tiers = Tiers(tower="unavailable")
    app = chain(tiers, store)
    for _ in range(4):
        await call(app)
    tiers.modes["tower"] = "saturated"
    await call(app)
    assert (await store.breaker_snapshot("echo", "tower")).state == "closed"
    await call(app)
    snap = await store.breaker_snapshot("echo", "tower")
    assert (snap.state, snap.failures, snap.saturations) == ("open", 4, 2)
    assert snap.retry_in == pytest.approx(900.0)
    manual_clock.advance(899)
    result = await call(app)
    assert result.states("backend_skipped")[0]["retry_in_s"] == 1.0
    assert tiers.calls["tower"] == 6


async def test_one_good_attempt_clears_the_counts(manual_clock):
    store = MemoryStore(clock=manual_clock)
    tiers = Tiers(tower="saturated")
    app = chain(tiers, store)
    await call(app)
    tiers.modes["tower"] = "ok"
    await call(app)
    tiers.modes["tower"] = "saturated"
    await call(app)
    snap = await store.breaker_snapshot("echo", "tower")
    assert (snap.state, snap.saturations) == ("closed", 1)


@on_virtual_time  # Failover waits the 7 s out before its same-tier retry
async def test_a_429_with_retry_after_opens_for_that_long_and_no_longer_than_the_cap(
    manual_clock,
):
    store = MemoryStore(clock=manual_clock)
    tiers = Tiers(tower=(429, [(b"retry-after", b"7")]))
    app = chain(tiers, store, retry_after_cap=60.0)
    await call(app)
    snap = await store.breaker_snapshot("echo", "tower")
    assert (snap.state, snap.failures) == ("open", 1)
    assert snap.retry_in == pytest.approx(7.0)
    manual_clock.advance(7)
    tiers.modes["tower"] = (503, [(b"retry-after", b"3600")])
    await call(app)  # the probe
    assert (await store.breaker_snapshot("echo", "tower")).retry_in == pytest.approx(60.0)


async def test_every_backend_open_answers_503_with_retry_after_naming_each_state(manual_clock):
    store = MemoryStore(clock=manual_clock)
    tiers = Tiers(tower="saturated", hosted="unavailable")
    app = chain(tiers, store, failure_threshold=1, saturation_threshold=1, probe_every=0)
    await call(app)
    manual_clock.advance(0.5)
    result = await call(app)
    assert result.status == 503
    assert result.headers["retry-after"] == "30"  # hosted's 29.5 s, rounded up
    backends = {b["backend"]: b for b in result.json()["error"]["backends"]}
    assert backends["tower"]["state"] == "open"
    assert backends["tower"]["retry_in_s"] == pytest.approx(899.5)
    assert backends["hosted"]["retry_in_s"] == pytest.approx(29.5)
    assert tiers.calls == {"tower": 1, "hosted": 1}


async def test_try_soonest_sends_one_forced_attempt_to_the_backend_reopening_first(
    manual_clock,
):
    store = MemoryStore(clock=manual_clock)
    tiers = Tiers(tower="saturated", hosted="unavailable")
    app = chain(
        tiers, store, failure_threshold=1, saturation_threshold=1, when_all_open="try_soonest"
    )
    await call(app)
    tiers.modes.update(tower="ok", hosted="ok")
    result = await call(app)
    assert result.status == 200
    assert result.headers["x-tierchain-backend"] == "hosted"
    assert tiers.calls == {"tower": 1, "hosted": 2}
    assert (await store.breaker_snapshot("echo", "hosted")).state == "closed"
    assert (await store.breaker_snapshot("echo", "tower")).state == "open"


async def test_a_cancelled_probe_gives_its_slot_to_the_next_request(manual_clock):
    store = MemoryStore(clock=manual_clock)
    tiers = Tiers(tower="saturated")
    app = chain(tiers, store)
    await call(app)
    await call(app)
    manual_clock.advance(900)
    tiers.modes["tower"] = "hang"
    leave = asyncio.Event()
    probe = asyncio.create_task(call(app, leave=leave))
    await asyncio.wait_for(tiers.entered.wait(), 1)
    other = await call(app)
    assert other.headers["x-tierchain-backend"] == "hosted"
    leave.set()  # the probing caller goes away
    with pytest.raises(Exception):  # noqa: B017 - no response was started
        await asyncio.wait_for(probe, 1)
    assert tiers.calls["tower"] == 3
    tiers.modes["tower"] = "ok"
    result = await call(app)
    assert result.headers["x-tierchain-backend"] == "tower"
    assert (await store.breaker_snapshot("echo", "tower")).state == "closed"


async def test_a_caller_leaving_is_not_held_against_the_backend():
    store = MemoryStore()
    tiers = Tiers(tower="hang")
    app = chain(tiers, store, failure_threshold=1)
    for _ in range(3):
        leave = asyncio.Event()
        task = asyncio.create_task(call(app, leave=leave))
        await asyncio.wait_for(tiers.entered.wait(), 1)
        tiers.entered.clear()
        leave.set()
        with pytest.raises(Exception):  # noqa: B017
            await asyncio.wait_for(task, 1)
    snap = await store.breaker_snapshot("echo", "tower")
    assert (snap.state, snap.failures, snap.saturations) == ("closed", 0, 0)


async def test_a_spent_budget_is_not_held_against_the_backend():
    store = MemoryStore()

    async def budget_spent(scope, receive, send):
        raise BudgetExhausted("spent")

    app = Failover(Breaker(budget_spent, store=store, failure_threshold=1), routes=ROUTES)
    await call(app)
    assert (await store.breaker_snapshot("echo", "tower")).state == "closed"


async def test_a_hundred_concurrent_requests_after_the_cooldown_send_one_probe(
    breaker_store, manual_clock
):
    tiers = Tiers(tower="saturated")
    app = chain(tiers, breaker_store)
    await call(app)
    await call(app)
    manual_clock.advance(900)
    tiers.modes["tower"] = "hang"
    answered = 0
    skipped_all = asyncio.Event()

    async def one() -> Result:
        nonlocal answered
        result = await call(app)
        answered += 1
        if answered == 99:
            skipped_all.set()
        return result

    tasks = [asyncio.create_task(one()) for _ in range(100)]
    await skipped_all.wait()  # (however long a busy machine takes: the test's timeout bounds it)
    done = [t for t in tasks if t.done()]
    assert len(done) == 99
    assert tiers.calls["tower"] == 3  # two saturations, then the one probe
    assert all(t.result().headers["x-tierchain-backend"] == "hosted" for t in done)
    tiers.release.set()
    results = await asyncio.gather(*tasks)
    assert sum(r.headers["x-tierchain-backend"] == "tower" for r in results) == 1
    assert (await breaker_store.breaker_snapshot("echo", "tower")).state == "closed"


@on_virtual_time
async def test_alone_in_front_of_one_backend_it_answers_503_fast_while_open():
    async with FakeBackend("tower", answers(502)) as tower:
        forwarder = Forwarder(backend=Backend("tower", tower.url))
        # probe_every=0: the whole failure_cooldown.
        app = Breaker(forwarder, failure_threshold=2, backend="tower", probe_every=0)
        async with serve(app) as url:
            for _ in range(2):  # each on a connection of its own: see fresh_post
                response = await fresh_post(url + "/v1/chat/completions", content=b"{}")
                assert response.status_code == 502
            t0 = now()
            response = await fresh_post(url + "/v1/chat/completions", content=b"{}")
            took = now() - t0
        await forwarder.aclose()
    assert response.status_code == 503
    assert took == 0.0  # no upstream round trip, no timer: answered from the ledger
    assert response.headers["retry-after"] == "30"
    error = response.json()["error"]
    (shown,) = error["backends"]
    # The cooldown runs on the real clock: on a busy machine a tenth of a second may be gone.
    assert {k: shown[k] for k in ("backend", "state")} == {"backend": "tower", "state": "open"}
    assert 28.5 <= shown["retry_in_s"] <= 30.0
    assert len(tower.requests) == 2


async def test_alone_it_still_passes_good_answers_through():
    async with FakeBackend("tower", streams(["Hel", "lo"])) as tower:
        forwarder = Forwarder(backend=Backend("tower", tower.url))
        app = Breaker(forwarder, backend=Backend("tower", tower.url))
        async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
            response = await client.post(url + "/v1/chat/completions", content=chat_request())
        await forwarder.aclose()
    assert response.status_code == 200
    assert b"Hel" in response.content


async def test_transitions_are_counted_logged_and_the_gauge_follows(manual_clock, metric, caplog):
    store = MemoryStore(clock=manual_clock)
    tiers = Tiers(tower="saturated")
    app = Failover(Breaker(tiers, store=store), routes=Routes({"gauge": [TOWER, HOSTED]}))
    labels = {"route": "gauge", "backend": "tower"}

    def seen(to: str) -> float:
        return metric("tierchain_breaker_transitions_total", to=to, **labels)

    caplog.set_level(logging.INFO, logger="tierchain")
    await call(app, model="gauge")
    await call(app, model="gauge")
    assert metric("tierchain_breaker_state", **labels) == 2
    assert seen("open") == 1
    await call(app, model="gauge")
    assert metric("tierchain_backend_skipped_total", **labels) == 1
    manual_clock.advance(900)
    tiers.modes["tower"] = "ok"
    await call(app, model="gauge")
    assert (seen("half_open"), seen("closed")) == (1, 1)
    assert metric("tierchain_breaker_state", **labels) == 0
    events = [r.event for r in caplog.records if getattr(r, "event", "").startswith("breaker.")]
    assert events == [
        "breaker.opened",
        "breaker.half_open",
        "breaker.recovery_probe",
        "breaker.closed",
    ]
    opened = next(r for r in caplog.records if getattr(r, "event", "") == "breaker.opened")
    assert opened.tierchain["reason"] == "saturation"
    assert opened.tierchain["retry_in_s"] == 900.0


async def test_a_store_that_fails_never_fails_a_request():
    class Broken(MemoryStore):
        async def breaker_acquire(self, *a, **kw):
            raise OSError("store down")

        async def breaker_record(self, *a, **kw):
            raise OSError("store down")

    result = await call(chain(Tiers(), Broken()))
    assert result.status == 200


@pytest.mark.parametrize(
    ("opts", "word"),
    [
        ({"failure_threshold": 0}, "failure_threshold"),
        ({"saturation_threshold": 1.5}, "saturation_threshold"),
        ({"failure_cooldown": -1}, "failure_cooldown"),
        ({"saturation_cooldown": float("inf")}, "saturation_cooldown"),
        ({"probe_lease": 0}, "probe_lease"),
        ({"when_all_open": "wait"}, "when_all_open"),
    ],
)
def test_options_are_checked_at_start_up(opts, word):
    with pytest.raises(ValueError, match=word):
        Breaker(Tiers(), **opts)


@on_virtual_time
async def test_the_seed_000_shape_a_saturated_tower_stops_receiving_work():
    """After two saturations the tower gets no more work and a request costs no wait for it."""
    import tierchain

    watchdog = getattr(tierchain, "SaturationWatchdog", None)
    async with (
        FakeBackend("tower", _silent) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        routes = Routes({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]})
        forwarder = Forwarder()
        inner: Any = (
            watchdog(forwarder, slow_after=0.3, suspect_for=0)  # (the breaker's own ledgers)
            if watchdog is not None
            else SaturateAfter(forwarder, 0.3)
        )
        app = Failover(Breaker(inner), routes=routes)
        async with serve(app) as url:
            waits = []
            for _ in range(4):
                t0 = now()
                response = await fresh_post(url + "/v1/chat/completions", content=chat_request())
                waits.append(now() - t0)
                assert response.status_code == 200
                assert response.headers["x-tierchain-backend"] == "hosted"
        await forwarder.aclose()
    assert len(tower.requests) == 2
    # Two windows of slow_after waited, then none: the tower is skipped without a wait.
    assert waits == [pytest.approx(0.3), pytest.approx(0.3), 0.0, 0.0]
    assert "tower;outcome=skipped" in response.headers["x-tierchain-attempts"]


async def _silent(ex) -> None:
    """A saturated GPU: accepts the request, answers 200, sends pings, never a token."""
    await ex.head()
    with_ping = asyncio.create_task(ex.write(b": ping\n\n"))
    await with_ping
    await ex.wait_closed_by_peer()


async def test_a_request_failover_does_not_route_passes_the_breaker_and_watchdog_untouched():
    from tierchain import SaturationWatchdog

    calls = []

    async def health(scope, receive, send):
        calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": b"down"})

    store = MemoryStore()
    app = Failover(
        Breaker(SaturationWatchdog(health, slow_after=0.01), store=store, failure_threshold=1),
        routes=Routes({"echo": [Backend("tower", "http://127.0.0.1:1")]}),
        paths=("/v1/",),
    )
    async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
        statuses = [(await client.get(url + "/healthz")).status_code for _ in range(3)]
    assert statuses == [500, 500, 500]
    assert calls == ["/healthz"] * 3
    snapshot = await store.breaker_snapshot("", "default")
    assert snapshot.state == "closed"
    assert snapshot.failures == 0
