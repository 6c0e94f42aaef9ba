"""Key limits over time, on the virtual clock: windows that slide, a Retry-After that is the
time until room, the 60 s least budget period, usage that could not be recorded, and the
``backend_budget`` skip as its state line (docs/limits.md).

The windows are 60 buckets wide (a second each for a minute): the virtual clock starts on a
whole second (1,000,000), so every request below lands at a known bucket and each
``Retry-After`` is an exact number of seconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest

from tierchain import Backend, Failover, Forwarder, Heartbeats, MemoryStore, Routes
from tierchain.keys import CallerKey, CallerKeys, load_keys_file
from tierchain.limits import BackendBudget, BackendBudgets, KeyLimits, load_budgets

from .support import FakeBackend, chat_request, now, on_virtual_time, parse_sse, serve, streams

KEY = "sk-gw-team-a-0123456789"


def answering(prompt: int, completion: int) -> Any:
    """The routed stack, standing in: a whole OpenAI answer with its usage block."""
    body = json.dumps(
        {
            "object": "chat.completion",
            "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion},
        }
    ).encode()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


def limited(key: CallerKey, inner: Any, store: Any = None) -> Any:
    return CallerKeys(KeyLimits(inner, store=store or MemoryStore()), keys=[key])


async def post(client: httpx.AsyncClient) -> httpx.Response:
    return await client.post(
        "/v1/chat/completions",
        content=chat_request(stream=False),
        headers={"authorization": f"Bearer {KEY}"},
    )


def states(raw: bytes, name: str) -> list[dict[str, Any]]:
    """The state lines named ``name`` the caller received."""
    lines = [json.loads(c) for e in parse_sse(raw) for c in e["comments"] if c.startswith("{")]
    return [line for line in lines if line["state"] == name]


def client_of(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


async def until(t0: float, at: float) -> None:
    """Sleep (virtually) until ``at`` seconds after ``t0``."""
    await asyncio.sleep(t0 + at - now())


@on_virtual_time
async def test_a_keys_rpm_window_slides_a_request_is_admitted_the_moment_its_oldest_leaves():
    app = limited(CallerKey("team-a", KEY, rpm=2), answering(1, 1))
    async with client_of(app) as client:
        t0 = now()
        assert (await post(client)).status_code == 200  # at 0 s
        await until(t0, 10)
        assert (await post(client)).status_code == 200  # at 10 s
        await until(t0, 59.5)
        assert (await post(client)).status_code == 429  # both still in the last minute
        await until(t0, 60)
        assert (await post(client)).status_code == 200  # the first left: room for one
        late = await post(client)
        assert late.status_code == 429  # the 10 s one is still in
        assert late.headers["retry-after"] == "10"
        await until(t0, 70)
        assert (await post(client)).status_code == 200


@on_virtual_time
async def test_a_key_limits_retry_after_is_the_seconds_until_its_window_has_room():
    app = limited(CallerKey("team-a", KEY, rpm=1), answering(1, 1))
    async with client_of(app) as client:
        t0 = now()
        assert (await post(client)).status_code == 200
        await until(t0, 17)
        refused = await post(client)
        await until(t0, 59.25)
        last = await post(client)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "43"  # 60 - 17: not the whole window
    assert "retry in 43s" in refused.json()["error"]["message"]
    assert last.headers["retry-after"] == "1"  # 0.75 s, in whole seconds rounded up


@on_virtual_time
async def test_a_keys_tokens_leave_its_tpm_window_with_their_bucket():
    app = limited(CallerKey("team-a", KEY, tpm=10), answering(8, 4))
    async with client_of(app) as client:
        t0 = now()
        assert (await post(client)).status_code == 200  # 12 tokens charged at 0 s
        await until(t0, 30)
        spent = await post(client)
        await until(t0, 59.9)
        still = await post(client)
        await until(t0, 60)
        room = await post(client)
    assert spent.status_code == 429
    assert spent.json()["error"]["code"] == "tpm_exceeded"
    assert spent.headers["retry-after"] == "30"
    assert still.status_code == 429
    assert room.status_code == 200


@on_virtual_time
async def test_a_budget_slides_over_its_period_too():
    key = CallerKey("team-a", KEY, budget_tokens=20, budget_period=3600)
    app = limited(key, answering(15, 10))
    async with client_of(app) as client:
        t0 = now()
        assert (await post(client)).status_code == 200
        await until(t0, 600)
        spent = await post(client)
        await until(t0, 3559.5)
        still = await post(client)
        await until(t0, 3560)
        room = await post(client)
    # An hour's buckets are 60 s wide and start on multiples of 60 s of the clock: the one
    # that holds 1,000,000 s began at 999,960 s, and leaves the window 3,600 s after that.
    assert spent.status_code == 429
    assert spent.json()["error"]["code"] == "budget_exceeded"
    assert spent.headers["retry-after"] == "2960"
    assert still.status_code == 429
    assert room.status_code == 200


def test_a_budget_period_is_at_least_60_s_for_a_key_and_for_a_backend(tmp_path):
    CallerKey("ok", KEY, budget_tokens=1, budget_period=60)
    BackendBudget("hosted", 1, 60)
    with pytest.raises(ValueError, match="budget_period"):
        CallerKey("short", KEY, budget_tokens=1, budget_period=59.9)
    with pytest.raises(ValueError, match="period"):
        BackendBudget("hosted", 1, 59)
    keys = tmp_path / "keys.toml"
    keys.write_text(
        f'[[keys]]\nname = "a"\nkey = "{KEY}"\nbudget_tokens = 5\nbudget_period = "59s"\n'
    )
    with pytest.raises(ValueError, match="budget_period"):
        load_keys_file(str(keys))
    keys.write_text('[[backend_budgets]]\nbackend = "hosted"\ntokens = 5\nperiod = "30s"\n')
    with pytest.raises(ValueError, match="period"):
        load_budgets(str(keys))
    keys.write_text('[[backend_budgets]]\nbackend = "hosted"\ntokens = 5\nperiod = "1m"\n')
    assert load_budgets(str(keys))[0].period == 60.0


class _BrokenUsage(MemoryStore):
    """A store whose admission works and whose usage writes fail (Redis went away)."""

    async def usage_record(self, windows: Any, totals: Any) -> None:
        raise ConnectionError("store unreachable")


async def test_usage_that_cannot_be_recorded_is_a_warning_and_the_answer_is_unaffected(
    caplog: pytest.LogCaptureFixture,
):
    app = limited(CallerKey("team-a", KEY, rpm=100), answering(3, 2), store=_BrokenUsage())
    with caplog.at_level(logging.WARNING, logger="tierchain"):
        async with client_of(app) as client:
            answer = await post(client)
    assert answer.status_code == 200
    assert answer.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 2}
    (record,) = [r for r in caplog.records if getattr(r, "event", None) == "usage.not_recorded"]
    assert record.levelno == logging.WARNING
    assert record.tierchain["key_name"] == "team-a"
    assert "store unreachable" in record.tierchain["error"]
    assert KEY not in record.getMessage()


@on_virtual_time
async def test_a_backend_whose_budget_is_spent_says_backend_busy_with_reason_budget():
    store = MemoryStore()
    budgets = (BackendBudget("hosted", 10, 3600),)
    async with (
        FakeBackend("hosted", streams(["paid"])) as hosted,
        FakeBackend("tower", streams(["local"])) as tower,
    ):
        forwarder = Forwarder()
        inner: Any = BackendBudgets(forwarder, store=store, budgets=budgets)
        routes = Routes({"echo": [Backend("hosted", hosted.url), Backend("tower", tower.url)]})
        app = Heartbeats(KeyLimits(Failover(inner, routes=routes), store=store, budgets=budgets))
        app = CallerKeys(app, keys=[CallerKey("team-a", KEY)])
        async with serve(app) as url, httpx.AsyncClient(timeout=30) as client:
            answers = [
                await client.post(
                    url + "/v1/chat/completions",
                    content=chat_request(),
                    headers={"authorization": f"Bearer {KEY}"},
                )
                for _ in range(2)
            ]
        await forwarder.aclose()
    first, second = answers
    assert first.headers["x-tierchain-backend"] == "hosted"  # its estimate spends the budget
    assert states(first.content, "backend_busy") == []
    assert second.status_code == 200
    assert second.headers["x-tierchain-backend"] == "tower"
    assert states(second.content, "backend_busy") == [
        {"state": "backend_busy", "backend": "hosted", "reason": "budget", "failing_over": True}
    ]
    assert len(hosted.requests) == 1


async def test_usage_in_one_bucket_adds_up_on_the_stores_own_clock(manual_clock):
    """MemoryStore(clock=...) counts on the clock it was given, and two amounts in one bucket
    add up (the mutants of ``usage_record`` that dropped either survived the layer's tests)."""
    store = MemoryStore(clock=manual_clock)
    await store.usage_record([("w", 60.0, 5)], [])
    manual_clock.advance(0.5)
    await store.usage_record([("w", 60.0, 7)], [])
    assert await store.window_sums([("w", 60.0)]) == [12]
    manual_clock.advance(59.5)  # the bucket of both leaves the window
    assert await store.window_sums([("w", 60.0)]) == [0]


@on_virtual_time
async def test_a_refusal_is_logged_as_usage_limited_with_its_key_limit_and_retry_after(caplog):
    app = limited(CallerKey("team-a", KEY, rpm=1), answering(1, 1))
    with caplog.at_level(logging.INFO, logger="tierchain"):
        async with client_of(app) as client:
            t0 = now()
            assert (await post(client)).status_code == 200
            await until(t0, 17)
            assert (await post(client)).status_code == 429
    (record,) = [r for r in caplog.records if getattr(r, "event", None) == "usage.limited"]
    assert record.levelno == logging.INFO
    assert record.tierchain == {"key_name": "team-a", "limit": "rpm", "retry_after_s": 43}
    assert KEY not in record.getMessage()


class _Unchecked(MemoryStore):
    """A store that cannot check limits (Redis went away) but takes usage."""

    async def window_hold(self, checks: Any) -> Any:
        raise ConnectionError("store unreachable")

    async def window_admit(self, checks: Any) -> Any:
        raise ConnectionError("store unreachable")


async def test_limits_that_cannot_be_checked_are_a_warning_and_the_request_goes_on(caplog):
    app = limited(CallerKey("team-a", KEY, rpm=1), answering(3, 2), store=_Unchecked())
    with caplog.at_level(logging.WARNING, logger="tierchain"):
        async with client_of(app) as client:
            answers = [await post(client) for _ in range(2)]  # rpm 1: both go on unchecked
    assert [a.status_code for a in answers] == [200, 200]
    records = [r for r in caplog.records if getattr(r, "event", None) == "usage.not_checked"]
    assert len(records) == 2
    assert all(r.levelno == logging.WARNING for r in records)
    assert records[0].tierchain["key_name"] == "team-a"
    assert "store unreachable" in records[0].tierchain["error"]


async def test_a_store_holds_on_its_own_clock_and_a_refusal_names_the_longest_wait(manual_clock):
    """MemoryStore.window_hold: costs in one bucket add up in ``used``, and when several
    checks refuse, the wait is the longest and the index is that check's, wherever it
    stands (mutants of each survived the layer's tests)."""
    from tierchain.store import WindowCheck

    store = MemoryStore(clock=manual_clock)  # starts on a whole second, 1,000,000

    def one(name: str, window: float) -> WindowCheck:
        return WindowCheck(name, window, 1, 1)

    a = await store.window_hold([WindowCheck("a", 60.0, 2, 1)])
    manual_clock.advance(0.5)
    b = await store.window_hold([WindowCheck("a", 60.0, 2, 1)])
    assert (a.refused, a.used, b.refused, b.used) == (None, (1,), None, (2,))
    assert await store.window_sums([("a", 60.0)]) == [2]
    manual_clock.advance(29.5)  # 1,000,030
    for name, window in (("x", 60.0), ("h", 3600.0)):
        assert (await store.window_hold([one(name, window)])).refused is None
    # Waits now: "a" 30 s (its bucket of 1,000,000), "x" 60 s, "h" 3,590 s (its 60 s
    # bucket began at 1,000,020 and leaves the hour at 1,003,620).
    many = await store.window_hold([one("x", 60.0), WindowCheck("a", 60.0, 2, 1), one("h", 3600)])
    assert many.refused == (pytest.approx(3590.0), 2)
    assert many.reset == (pytest.approx(60.0), pytest.approx(30.0), pytest.approx(3590.0))
    first = await store.window_hold([one("h", 3600.0), WindowCheck("a", 60.0, 2, 1)])
    assert first.refused == (pytest.approx(3590.0), 0)
