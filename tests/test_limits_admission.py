"""What KeyLimits does before a request goes on, byte for byte, on the virtual clock: the
tokens a request holds in its key's windows while it runs, the body it reads for them and
hands on, ``max_parallel`` per key, and every refusal's exact status, headers and body
(docs/limits.md).

The layer is driven as ASGI directly (the messages it sends are what is checked, so a
header name that is not lowercase, as ASGI wants it, is seen); the routed stack behind it
is a small app that reads the body, notes what the key's windows hold at that moment, and
answers.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tierchain import MemoryStore
from tierchain.accounts import total_field, window_name
from tierchain.keys import CallerKey, CallerKeys
from tierchain.limits import KeyLimits
from tierchain.usage import reservation

from .support import now, on_virtual_time

KEY = "sk-gw-team-a-0123456789"
OTHER = "sk-gw-team-b-9876543210"
ASKING = json.dumps(
    {"model": "echo", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
).encode()
NAMING_NONE = json.dumps(
    {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
).encode()
PROMPT = 22  # the prompt estimates of the two bodies above (tierchain.usage.reservation)
PROMPT_NONE = 17


class Routed:
    """The routed stack, standing in: reads the body, notes what the key's token windows
    hold while it runs, waits for ``gate`` (if any), and answers a whole OpenAI body."""

    def __init__(
        self, store: MemoryStore, gate: asyncio.Event | None = None, spends: int = 1
    ) -> None:
        self.store = store
        self.spends = spends
        self.gate = gate
        self.bodies: list[bytes] = []
        self.held: list[list[int]] = []
        self.arrived = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.bodies.append(body)
        windows = [(window_name("tpm", "team-a"), 60.0), (window_name("budget", "team-a"), 3600.0)]
        self.held.append(await self.store.window_sums(windows))
        self.arrived.set()
        if self.gate is not None:
            await self.gate.wait()
        answer = {
            "object": "chat.completion",
            "choices": [],
            "usage": {"prompt_tokens": self.spends},
        }
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})


def gateway(keys: list[CallerKey], inner: Any, store: MemoryStore, **options: Any) -> Any:
    return CallerKeys(KeyLimits(inner, store=store, **options), keys=keys)


class Answer:
    """What the caller got: the status, the raw ASGI headers, the body."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        start = messages[0]
        self.status: int = start["status"]
        self.headers: list[tuple[bytes, bytes]] = list(start.get("headers", []))
        self.body = b"".join(m.get("body", b"") for m in messages[1:])

    def header(self, name: bytes) -> bytes | None:
        found = [v for k, v in self.headers if k == name]
        return found[0] if found else None

    def json(self) -> Any:
        return json.loads(self.body)


async def ask(app: Any, body: bytes = ASKING, key: str = KEY, receive: Any = None) -> Answer:
    """One POST to /v1/chat/completions, as the ASGI server would hand it on."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"gw"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"authorization", f"Bearer {key}".encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("gw", 80),
    }
    sent = False

    async def one_body() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the caller stays: no disconnect
        raise AssertionError("unreachable")

    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await app(scope, receive or one_body, send)
    return Answer(messages)


def test_the_bodies_prompt_estimate_is_the_one_these_tests_count_with():
    assert asyncio.run(reservation(ASKING, 0)) == (PROMPT, PROMPT + 100)
    assert asyncio.run(reservation(NAMING_NONE, 0)) == (PROMPT_NONE, PROMPT_NONE)


@on_virtual_time
async def test_a_request_holds_its_prompt_and_max_tokens_in_a_tpm_only_keys_window():
    store = MemoryStore()
    inner = Routed(store)
    app = gateway([CallerKey("team-a", KEY, tpm=1000)], inner, store)
    answer = await ask(app)
    assert answer.status == 200
    assert inner.bodies == [ASKING]  # read once to reserve, handed on whole
    assert inner.held == [[PROMPT + 100, 0]]
    assert answer.header(b"x-ratelimit-remaining-tokens") == str(1000 - PROMPT - 100).encode()


@on_virtual_time
async def test_a_request_holds_its_prompt_and_max_tokens_in_a_budget_only_keys_window():
    store = MemoryStore()
    inner = Routed(store)
    key = CallerKey("team-a", KEY, budget_tokens=5000, budget_period=3600)
    answer = await ask(gateway([key], inner, store))
    assert answer.status == 200
    assert inner.bodies == [ASKING]
    assert inner.held == [[0, PROMPT + 100]]


@on_virtual_time
async def test_a_request_naming_no_max_tokens_holds_its_keys_default_before_the_layers():
    store = MemoryStore()
    inner = Routed(store)
    keys = [
        CallerKey("team-a", KEY, tpm=10_000, default_max_tokens=50),
        CallerKey("team-b", OTHER, tpm=10_000),
    ]
    app = gateway(keys, inner, store, default_max_tokens=700)
    assert (await ask(app, NAMING_NONE)).status == 200
    assert inner.held[0] == [PROMPT_NONE + 50, 0]  # the key's own default wins
    b = await ask(app, NAMING_NONE, key=OTHER)
    assert b.header(b"x-ratelimit-remaining-tokens") == str(10_000 - PROMPT_NONE - 700).encode()


@on_virtual_time
async def test_a_key_with_only_an_rpm_holds_no_tokens_and_its_body_is_never_read_first():
    store = MemoryStore()
    inner = Routed(store)
    app = gateway([CallerKey("team-a", KEY, rpm=5)], inner, store)
    answer = await ask(app)
    assert answer.status == 200
    assert inner.bodies == [ASKING]
    assert inner.held == [[0, 0]]
    assert await store.window_sums([(window_name("rpm", "team-a"), 60.0)]) == [1]


@on_virtual_time
async def test_a_body_over_max_body_for_a_token_limited_key_is_413_and_goes_no_further():
    store = MemoryStore()
    inner = Routed(store)
    app = gateway([CallerKey("team-a", KEY, tpm=1000)], inner, store, max_body=len(ASKING) - 1)
    answer = await ask(app)
    assert answer.status == 413
    assert inner.bodies == []


@on_virtual_time
async def test_a_body_slower_than_body_timeout_for_a_token_limited_key_is_408_at_that_time():
    store = MemoryStore()
    inner = Routed(store)
    app = gateway([CallerKey("team-a", KEY, tpm=1000)], inner, store, body_timeout=7.0)
    parts = [{"type": "http.request", "body": ASKING[:10], "more_body": True}]

    async def trickle() -> dict[str, Any]:
        if parts:
            return parts.pop()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    t0 = now()
    answer = await ask(app, receive=trickle)
    assert answer.status == 408
    assert now() - t0 == pytest.approx(7.0)
    assert inner.bodies == []


class _Unchecked(MemoryStore):
    """A store that cannot check limits (Redis went away) but takes usage: its holds asked."""

    holds = 0

    async def window_hold(self, checks: Any) -> Any:
        self.holds += 1
        raise ConnectionError("store unreachable")


def streaming(events: int) -> Any:
    """The routed stack, standing in: a stream of ``events`` data events, then [DONE]."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for i in range(events):
            chunk = b'data: {"choices": [{"delta": {"content": "%d"}}]}\n\n' % i
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


@on_virtual_time
async def test_a_token_limited_stream_its_store_cannot_check_runs_whole_and_asks_no_more():
    store = _Unchecked()
    app = gateway([CallerKey("team-a", KEY, tpm=10)], streaming(500), store)
    answer = await ask(app)  # holds 122 it could not write; streams 500 events past it
    assert answer.status == 200
    assert answer.body.count(b"data: {") == 500
    assert answer.body.endswith(b"data: [DONE]\n\n")
    assert store.holds == 1  # the admission's: no stream step asks a store that failed


@on_virtual_time
async def test_the_app_behind_a_token_limited_key_still_hears_the_caller_leave():
    heard: list[str] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body", False):
            pass
        heard.append((await receive())["type"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    messages = [
        {"type": "http.disconnect"},
        {"type": "http.request", "body": ASKING[10:], "more_body": False},
        {"type": "http.request", "body": ASKING[:10], "more_body": True},
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop()

    store = MemoryStore()
    await ask(gateway([CallerKey("team-a", KEY, tpm=1000)], inner, store), receive=receive)
    assert heard == ["http.disconnect"]


# -- max_parallel ----------------------------------------------------------------------


@on_virtual_time
async def test_max_parallel_refuses_the_one_too_many_with_its_exact_429():
    store = MemoryStore()
    gate = asyncio.Event()
    inner = Routed(store, gate)
    app = gateway([CallerKey("team-a", KEY, max_parallel=1)], inner, store)
    first = asyncio.create_task(ask(app))
    async with asyncio.timeout(60):  # (virtual: a second admitted would wait at the gate)
        await inner.arrived.wait()
        second = await ask(app)
    gate.set()
    assert (await first).status == 200
    assert second.status == 429
    assert second.header(b"retry-after") == b"1"
    assert second.json() == {
        "error": {
            "message": "key 'team-a' is over 1 requests in flight (max_parallel); retry in 1s",
            "type": "rate_limit_error",
            "code": "parallel_exceeded",
        }
    }
    third = await ask(app)  # the first gave its place back
    assert third.status == 200


@on_virtual_time
async def test_max_parallel_counts_each_key_apart():
    store = MemoryStore()
    gate = asyncio.Event()
    inner = Routed(store, gate)
    keys = [
        CallerKey("team-a", KEY, max_parallel=1),
        CallerKey("team-b", OTHER, max_parallel=1),
    ]
    app = gateway(keys, inner, store)
    first = asyncio.create_task(ask(app))
    async with asyncio.timeout(60):  # (virtual: one refused would never arrive)
        await inner.arrived.wait()
        inner.arrived.clear()
        other = asyncio.create_task(ask(app, key=OTHER))
        await inner.arrived.wait()
    gate.set()
    assert [(await first).status, (await other).status] == [200, 200]


@on_virtual_time
async def test_a_request_refused_by_its_window_gives_its_parallel_place_back():
    store = MemoryStore()
    inner = Routed(store)
    app = gateway([CallerKey("team-a", KEY, rpm=1, max_parallel=1)], inner, store)
    assert (await ask(app)).status == 200
    refused = await ask(app)
    assert refused.json()["error"]["code"] == "rpm_exceeded"
    await asyncio.sleep(60)
    assert (await ask(app)).status == 200  # not parallel_exceeded: no place was kept


# -- what each refusal says --------------------------------------------------------------


@on_virtual_time
async def test_an_rpm_refusal_is_exactly_429_its_headers_and_an_openai_error():
    store = MemoryStore()
    app = gateway([CallerKey("team-a", KEY, rpm=2)], Routed(store), store)
    t0 = now()
    for _ in range(2):
        assert (await ask(app)).status == 200
    await asyncio.sleep(t0 + 17.5 - now())
    refused = await ask(app)
    assert refused.status == 429
    assert refused.headers == [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(refused.body)).encode()),
        (b"x-ratelimit-limit-requests", b"2"),
        (b"x-ratelimit-remaining-requests", b"0"),
        (b"x-ratelimit-reset-requests", b"43s"),
        (b"retry-after", b"43"),
        (b"connection", b"close"),
    ]
    assert refused.json() == {
        "error": {
            "message": "key 'team-a' is over 2 requests per minute; retry in 43s",
            "type": "rate_limit_error",
            "code": "rpm_exceeded",
        }
    }
    totals = await store.usage_totals()
    assert totals[total_field("team-a", "-", "-", "refused")] == 1


@on_virtual_time
async def test_a_tpm_refusal_names_the_keys_tokens_per_minute():
    store = MemoryStore()
    app = gateway([CallerKey("team-a", KEY, tpm=10)], Routed(store, spends=12), store)
    assert (await ask(app)).status == 200  # admitted with room left; spends 12
    refused = await ask(app)
    assert refused.status == 429
    assert refused.json()["error"] == {
        "message": "key 'team-a' is over 10 tokens per minute; retry in 60s",
        "type": "rate_limit_error",
        "code": "tpm_exceeded",
    }
    assert refused.header(b"x-should-retry") is None


@on_virtual_time
async def test_a_spent_budget_says_when_it_renews_and_that_no_sdk_should_retry(monkeypatch):
    from tierchain._runtime import clock

    monkeypatch.setattr(clock, "wall", lambda: 1_800_000_000.0)
    store = MemoryStore()
    key = CallerKey("team-a", KEY, budget_tokens=1, budget_period=3600)
    app = gateway([key], Routed(store), store)
    assert (await ask(app)).status == 200  # spends 1 (its usage): the budget is spent
    await asyncio.sleep(100)
    refused = await ask(app)
    # An hour's buckets are 60 s wide: the one that holds the clock's 1,000,000 s began at
    # 999,960 s and leaves the hour at 1,003,560 s, 3,460 s after this refusal.
    at = "2027-01-15T08:57:40Z"  # 1,800,000,000 + 3,460 s
    assert refused.status == 429
    assert refused.header(b"retry-after") == b"3460"
    assert refused.header(b"x-should-retry") == b"false"
    assert refused.json() == {
        "error": {
            "message": f"key 'team-a' spent its budget of 1 tokens per 1h; it has room again "
            f"in 3460s (at {at})",
            "type": "rate_limit_error",
            "code": "budget_exceeded",
            "renews_in_s": 3460,
            "renews_at": at,
        }
    }
