"""PreferBackend: a caller's hint and an operator's pin reorder, never filter."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tierchain.memory_store
from tierchain import Backend, Failover, Forwarder, PreferBackend, Routes
from tierchain.request import SCOPE_KEY, TierRequest
from tierchain.store import MemoryStore

from .support import FakeBackend, answers, chat_request, openai_stream, refused_url, serve, streams

# -- over the network: PreferBackend(Failover(Forwarder(), routes=...)) ----------


def gateway(routes: dict[str, list[Backend]], **opts: Any) -> tuple[PreferBackend, Forwarder]:
    forwarder = Forwarder()
    # (retries=0: a 503 here only moves the chain on; second tries are tests/test_retries.py's)
    return PreferBackend(Failover(forwarder, routes=Routes(routes), retries=0), **opts), forwarder


async def post(url: str, prefer: str | None = None, *, model: str = "echo") -> httpx.Response:
    headers = {} if prefer is None else {"X-Prefer-Backend": prefer}
    async with httpx.AsyncClient(timeout=5) as client:
        return await client.post(
            url + "/v1/chat/completions", content=chat_request(model), headers=headers
        )


async def test_the_caller_can_stick_to_the_fallback():
    async with (
        FakeBackend("tower", streams(["from ", "tower"])) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        app, fwd = gateway({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]})
        async with serve(app) as url:
            stuck = [await post(url, "hosted") for _ in range(3)]
            plain = await post(url)
        await fwd.aclose()
    for response in stuck:
        assert response.status_code == 200
        assert response.content == b"".join(openai_stream(["from ", "hosted"]))
        assert response.headers["x-tierchain-backend"] == "hosted"
    assert len(hosted.requests) == 3
    assert len(tower.requests) == 1  # only the request without the header
    assert plain.headers["x-tierchain-backend"] == "tower"


async def test_the_other_tiers_stay_behind_it():
    async with (
        FakeBackend("tower", answers(503)) as tower,
        FakeBackend("mid", answers(503)) as mid,
        FakeBackend("hosted", answers(503)) as hosted,
    ):
        app, fwd = gateway(
            {
                "echo": [
                    Backend("tower", tower.url),
                    Backend("mid", mid.url),
                    Backend("hosted", hosted.url),
                ]
            }
        )
        async with serve(app) as url:
            response = await post(url, "hosted")
        await fwd.aclose()
    assert response.status_code == 503  # every tier said 503: the caller is told so
    assert [a["backend"] for a in response.json()["error"]["attempts"]] == [
        "hosted",
        "tower",
        "mid",
    ]


async def test_a_preferred_backend_that_fails_still_falls_back():
    async with FakeBackend("tower", streams(["saved"])) as tower:
        app, fwd = gateway(
            {"echo": [Backend("tower", tower.url), Backend("hosted", refused_url())]}
        )
        async with serve(app) as url:
            response = await post(url, "hosted")
        await fwd.aclose()
    assert response.status_code == 200
    assert response.content == b"".join(openai_stream(["saved"]))
    assert response.headers["x-tierchain-attempts"] == (
        "hosted;outcome=connect_refused, tower;outcome=ok"
    )


async def test_an_unknown_name_changes_nothing_over_the_network(caplog, metric):
    before = metric("tierchain_backend_preference_total", applied="false")
    async with (
        FakeBackend("tower", streams(["ok"])) as tower,
        FakeBackend("hosted") as hosted,
    ):
        app, fwd = gateway({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]})
        async with serve(app) as url:
            with caplog.at_level(logging.INFO, logger="tierchain"):
                response = await post(url, "hostd")
        await fwd.aclose()
    assert response.status_code == 200
    assert response.headers["x-tierchain-backend"] == "tower"
    assert hosted.requests == []
    [record] = [
        r for r in caplog.records if getattr(r, "event", "") == "request.backend_preference"
    ]
    assert record.tierchain == {
        "requested": "hostd",
        "applied": False,
        "reason": "not_in_chain",
        "route": "echo",
    }
    assert metric("tierchain_backend_preference_total", applied="false") == before + 1


async def test_pins_apply_to_every_caller_until_expiry_and_then_stop(monkeypatch):
    store = MemoryStore()
    async with (
        FakeBackend("tower", streams(["t"])) as tower,
        FakeBackend("hosted", streams(["h"])) as hosted,
    ):
        app, fwd = gateway(
            {"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]}, store=store
        )
        async with serve(app) as url:
            await store.set_pin("echo", "hosted", 60)
            pinned = await asyncio.gather(post(url), post(url), post(url))
            # A minute later (the store's wall clock moved on): the pin has expired.
            later = SimpleNamespace(time=lambda: time.time() + 61, monotonic=time.monotonic)
            monkeypatch.setattr(tierchain.memory_store, "time", later)
            after = await post(url)
        await fwd.aclose()
    assert [r.headers["x-tierchain-backend"] for r in pinned] == ["hosted"] * 3
    assert after.headers["x-tierchain-backend"] == "tower"
    assert len(tower.requests) == 1


async def test_the_header_beats_a_pin_and_the_pinned_backend_comes_second():
    store = MemoryStore()
    await store.set_pin("echo", "hosted", 60)
    async with (
        FakeBackend("tower", answers(503)) as tower,
        FakeBackend("mid", answers(503)) as mid,
        FakeBackend("hosted", answers(503)) as hosted,
    ):
        app, fwd = gateway(
            {
                "echo": [
                    Backend("tower", tower.url),
                    Backend("mid", mid.url),
                    Backend("hosted", hosted.url),
                ]
            },
            store=store,
        )
        async with serve(app) as url:
            response = await post(url, "mid")
        await fwd.aclose()
    assert [a["backend"] for a in response.json()["error"]["attempts"]] == [
        "mid",
        "hosted",
        "tower",
    ]


# -- in process: exactly what order Failover is handed ------------------------------

ROUTES = Routes(
    {
        "echo": [
            Backend("tower", "http://127.0.0.1:1"),
            Backend("hosted", "http://127.0.0.1:2"),
            Backend("l" * 64, "http://127.0.0.1:3"),
        ],
        "deep": [Backend("tower", "http://127.0.0.1:1")],
    }
)


class Recorder:
    """An inner app that answers 200 and remembers the chain its request got."""

    def __init__(self) -> None:
        self.chains: list[list[str]] = []

    async def __call__(self, scope, receive, send) -> None:
        req = TierRequest.of(scope)
        if req.attempt is not None and req.attempt.n == 1:
            self.chains.append([b.name for b in req.chain])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})


async def call(app, headers: list[tuple[bytes, bytes]], *, model: str = "echo") -> dict:
    body = chat_request(model)
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": headers,
    }
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # a caller that stays

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    return scope


def stack(**opts: Any) -> tuple[PreferBackend, Recorder]:
    recorder = Recorder()
    return PreferBackend(Failover(recorder, routes=ROUTES), **opts), recorder


DEFAULT = ["tower", "hosted", "l" * 64]


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        ([b"hostd"], "not_in_chain"),
        ([b"l" * 65], "too_long"),  # its first 64 characters do name a backend
        ([b"  " + b"x" * 70 + b"  "], "too_long"),
        ([b"hos\tted"], "control_characters"),
        ([b"hosted\x00"], "control_characters"),
        ([b"hosted\x1b[31m"], "control_characters"),
        ([b"host\xc3\xa9d"], "not_ascii"),
        ([b"\xff\xfe"], "not_ascii"),
        ([b"hosted,tower"], "list"),
        ([b"hosted, tower"], "list"),
        ([b"hosted", b"tower"], "list"),
        ([b"   "], "empty"),
    ],
)
async def test_unknown_over_long_control_character_and_list_values_change_nothing(
    values, reason, caplog
):
    app, recorder = stack()
    with caplog.at_level(logging.INFO, logger="tierchain"):
        await call(app, [(b"x-prefer-backend", v) for v in values])
    assert recorder.chains == [DEFAULT]
    [record] = [
        r for r in caplog.records if getattr(r, "event", "") == "request.backend_preference"
    ]
    assert record.tierchain["applied"] is False
    assert record.tierchain["reason"] == reason
    shown = record.tierchain["requested"]
    assert len(shown) <= 64 + 3
    assert all(0x20 <= ord(c) < 0x7F for c in shown)


async def test_the_value_is_trimmed_and_the_header_name_is_case_insensitive():
    app, recorder = stack()
    await call(app, [(b"X-Prefer-Backend", b"  hosted\t")])
    assert recorder.chains == [["hosted", "tower", "l" * 64]]


async def test_a_64_character_name_applies():
    app, recorder = stack()
    await call(app, [(b"x-prefer-backend", b"l" * 64)])
    assert recorder.chains == [["l" * 64, "tower", "hosted"]]


async def test_the_header_name_is_configurable():
    app, recorder = stack(header="X-Tier")
    await call(app, [(b"x-prefer-backend", b"hosted"), (b"x-tier", b"hosted")])
    assert recorder.chains == [["hosted", "tower", "l" * 64]]


async def test_a_request_without_header_or_store_is_left_alone():
    app, _ = stack()
    scope: dict[str, Any] = {"type": "http", "method": "GET", "path": "/v1/models", "headers": []}

    async def inner(scope, receive, send) -> None:
        assert SCOPE_KEY not in scope

    app.app = inner
    await app(scope, None, None)


async def test_the_preference_is_logged_counted_and_set_on_the_current_span(caplog, metric):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    prefer, recorder = stack()

    async def with_server_span(scope, receive, send) -> None:
        with tracer.start_as_current_span("POST /v1/chat/completions"):
            await prefer(scope, receive, send)

    before = metric("tierchain_backend_preference_total", applied="true")
    with caplog.at_level(logging.INFO, logger="tierchain"):
        await call(with_server_span, [(b"x-prefer-backend", b"hosted")])
    assert metric("tierchain_backend_preference_total", applied="true") == before + 1
    assert recorder.chains == [["hosted", "tower", "l" * 64]]
    [record] = [
        r for r in caplog.records if getattr(r, "event", "") == "request.backend_preference"
    ]
    assert record.tierchain == {
        "requested": "hosted",
        "applied": True,
        "reason": "applied",
        "route": "echo",
    }
    [span] = exporter.get_finished_spans()
    assert span.attributes["tierchain.preference.requested"] == "hosted"
    assert span.attributes["tierchain.preference.applied"] is True
    assert [e.name for e in span.events] == ["request.backend_preference"]
    provider.shutdown()


async def test_a_request_that_is_never_routed_still_logs_its_preference(caplog):
    app, _ = stack()
    with caplog.at_level(logging.INFO, logger="tierchain"):
        await call(app, [(b"x-prefer-backend", b"hosted")], model="nope")
    [record] = [
        r for r in caplog.records if getattr(r, "event", "") == "request.backend_preference"
    ]
    assert record.tierchain["reason"] == "not_routed"
    assert record.tierchain["applied"] is False


async def test_a_pin_for_a_backend_not_in_the_chain_changes_nothing():
    store = MemoryStore()
    await store.set_pin("deep", "hosted", 60)  # hosted is not in deep's chain
    app, recorder = stack(store=store)
    await call(app, [], model="deep")
    assert recorder.chains == [["tower"]]


class BrokenStore(MemoryStore):
    def __init__(self, *, hang: bool) -> None:
        super().__init__()
        self.hang = hang

    async def get_pin(self, route: str) -> str | None:
        if self.hang:
            await asyncio.Event().wait()
        raise ConnectionError("store is down")


@pytest.mark.parametrize("hang", [False, True])
async def test_a_store_that_fails_or_hangs_costs_the_pin_but_not_the_header(hang, caplog):
    app, recorder = stack(store=BrokenStore(hang=hang), pin_timeout=0.05)
    with caplog.at_level(logging.WARNING, logger="tierchain"):
        await call(app, [(b"x-prefer-backend", b"hosted")])
    assert recorder.chains == [["hosted", "tower", "l" * 64]]
    assert any(getattr(r, "event", "") == "request.pin_lookup_failed" for r in caplog.records)


async def test_prefer_backend_inside_failover_says_so_once_and_breaks_nothing(caplog):
    recorder = Recorder()
    app = Failover(PreferBackend(recorder), routes=ROUTES)
    with caplog.at_level(logging.ERROR, logger="tierchain"):
        await call(app, [(b"x-prefer-backend", b"hosted")])
        await call(app, [(b"x-prefer-backend", b"hosted")])
    assert recorder.chains == [DEFAULT, DEFAULT]
    misplaced = [r for r in caplog.records if getattr(r, "event", "") == "prefer.misplaced"]
    assert len(misplaced) == 1
    assert "outside Failover" in misplaced[0].tierchain["message"]


@pytest.mark.parametrize("header", ["", "X Prefer", "X-Prefer:", "Prefé"])
def test_a_bad_header_name_is_refused_at_start_up(header):
    with pytest.raises(ValueError, match="header must be"):
        PreferBackend(Recorder(), header=header)


# -- allow=: who may steer ------------------------------------------------------------


def _signed_in(scope: dict[str, Any]) -> bool:
    """Only callers that carry the gateway's team key may steer (a stand-in for real auth)."""
    return (b"x-team-key", b"team") in scope["headers"]


async def test_allow_keeps_anonymous_callers_off_the_paid_tier(caplog, metric):
    async with (
        FakeBackend("tower", streams(["local"])) as tower,
        FakeBackend("hosted", streams(["paid"])) as hosted,
    ):
        app, fwd = gateway(
            {"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]},
            allow=_signed_in,
        )
        before = metric("tierchain_backend_preference_total", applied="false")
        async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
            with caplog.at_level(logging.INFO, logger="tierchain"):
                anonymous = await post(url, "hosted")
                team = await client.post(
                    url + "/v1/chat/completions",
                    content=chat_request(),
                    headers={"X-Prefer-Backend": "hosted", "X-Team-Key": "team"},
                )
        await fwd.aclose()
    assert anonymous.status_code == 200
    assert anonymous.headers["x-tierchain-backend"] == "tower"
    assert team.headers["x-tierchain-backend"] == "hosted"
    assert len(hosted.requests) == 1
    assert metric("tierchain_backend_preference_total", applied="false") == before + 1
    refused, applied = (
        r.tierchain
        for r in caplog.records
        if getattr(r, "event", "") == "request.backend_preference"
    )
    assert refused == {"requested": "hosted", "applied": False, "reason": "not_allowed"}
    assert applied["reason"] == "applied"


async def test_an_allow_predicate_that_raises_refuses_and_never_fails_the_request(caplog):
    def broken(scope: dict[str, Any]) -> bool:
        raise KeyError("user")

    async with (
        FakeBackend("tower", streams(["local"])) as tower,
        FakeBackend("hosted", streams(["paid"])) as hosted,
    ):
        app, fwd = gateway(
            {"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]},
            allow=broken,
        )
        async with serve(app) as url:
            with caplog.at_level(logging.INFO, logger="tierchain"):
                response = await post(url, "hosted")
        await fwd.aclose()
    assert response.status_code == 200
    assert response.headers["x-tierchain-backend"] == "tower"
    assert not hosted.requests
    [failed] = [
        r for r in caplog.records if getattr(r, "event", "") == "request.prefer_allow_failed"
    ]
    assert failed.levelno == logging.WARNING
    assert "KeyError" in failed.tierchain["error"]


async def test_a_caller_that_may_not_steer_still_gets_the_operators_pin():
    store = MemoryStore()
    await store.set_pin("echo", "hosted", ttl=60)
    async with (
        FakeBackend("tower", streams(["local"])) as tower,
        FakeBackend("mid", streams(["mid"])) as mid,
        FakeBackend("hosted", streams(["paid"])) as hosted,
    ):
        app, fwd = gateway(
            {
                "echo": [
                    Backend("tower", tower.url),
                    Backend("mid", mid.url),
                    Backend("hosted", hosted.url),
                ]
            },
            store=store,
            allow=lambda scope: False,
        )
        async with serve(app) as url:
            response = await post(url, "mid")
        await fwd.aclose()
    assert response.headers["x-tierchain-backend"] == "hosted"
    assert not mid.requests
