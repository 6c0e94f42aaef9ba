"""Progress at a useful rate after the first byte too (tierchain.decode, DecodeRate).

A committed stream on a tier with a later tier whose decode rate stays below its limit for
two spans (2 s each) is starved and continued on the next tier like a stall; the last
tier, a stream that cannot be continued, a pause and a silence are never cut for it. Real
uvicorn gateways (the README's stack) in front of fakes speaking each wire format, on a
virtual clock; the tower slows from a token every 50 ms to one every 0.5 to 1 s, as a
GPU taken by a game does.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

import tierchain.watch
from tierchain import Backend, Failover, Forwarder, MemoryStore, Routes, SaturationWatchdog
from tierchain._disconnect import WATCH_AFTER
from tierchain._runtime import deadlines
from tierchain.decode import DecodeWatch
from tierchain.learned import COLD, COLD_OTHER, DecodeRate, LearnedGap

from .support import (
    Exchange,
    FakeBackend,
    Script,
    now,
    on_virtual_time,
    one_request,
    serve,
    whole_stack,
)
from .test_continuation import (
    FORMATS,
    FULL,
    HEADERS,
    TOKENS,
    finisher,
    gateway,
    partial_of,
    posts,
    raw,
    read_with_sdk,
    stream_of,
)


def slowing(
    fmt: str, *, after: int, every: float, fast: float = 0.05
) -> tuple[Script, list[float]]:
    """The whole answer, a token every ``fast`` seconds, then (``after`` tokens in; < 0:
    never) one every ``every`` seconds; the moment it slowed is kept."""
    events, opening = stream_of(fmt, TOKENS, tier="tower")
    slowed: list[float] = []

    async def script(ex: Exchange) -> None:
        if ex.request.method == "GET":
            await ex.respond(404, b"{}")
            return
        await ex.head(200, HEADERS.get(fmt))
        for event in events[:opening]:
            await ex.write(event)
        for n, event in enumerate(events[opening:]):
            await ex.write(event)
            if n == after:
                slowed.append(now())
            await asyncio.sleep(every if 0 <= after <= n else fast)
        await ex.end()

    return script, slowed


def timed_finisher(fmt: str, asked: list[float]) -> Script:
    finish = finisher(fmt)

    async def script(ex: Exchange) -> None:
        if ex.request.method == "POST":
            asked.append(now())
        await finish(ex)

    return script


STARVED = b'"state":"backend_starved","backend":"tower","reason":"slow_decode"'


# -- the pieces --------------------------------------------------------------------------


def test_the_normal_decode_rate_is_learned_and_judged_by_a_fraction_of_its_slow_end():
    rate = DecodeRate()
    assert rate.limit("tower", "local") == (COLD["local"].decode, False) == (2.0, False)
    assert rate.limit("api", "hosted") == (COLD_OTHER.decode, False) == (1.0, False)
    assert not rate.observe("tower", 5, 1.0)  # too short a stream to teach
    for _ in range(5):
        assert rate.observe("tower", 61, 3.0)  # 20 tokens a second
    assert rate.normal("tower") == pytest.approx(20.0)
    assert rate.limit("tower", "local") == (pytest.approx(5.0), True)  # a quarter of it
    copy = DecodeRate()
    copy.adopt("tower", rate.export("tower"))  # (as SharedNormals hands it to a replica)
    assert copy.limit("tower", "local") == (pytest.approx(5.0), True)
    assert DecodeRate(rate=40.0).limit("any", None) == (10.0, True)


def test_decode_options_are_checked():
    with pytest.raises(ValueError, match="slow_decode"):
        SaturationWatchdog(Forwarder(), slow_decode=1.5)
    with pytest.raises(ValueError, match="decode_rate"):
        SaturationWatchdog(Forwarder(), decode_rate="fast")
    with pytest.raises(ValueError, match="decode_span"):
        SaturationWatchdog(Forwarder(), decode_span=-1)
    assert SaturationWatchdog(Forwarder(), decode_rate=0).decode is None
    fixed = SaturationWatchdog(Forwarder(), decode_rate=30, slow_decode=0.5).decode
    assert fixed is not None
    assert fixed.limit("t", "local") == (15.0, True)
    shared = SaturationWatchdog(Forwarder(), store=MemoryStore()).normals
    assert shared is not None
    assert "decode" in shared.parts


# -- a starved stream is continued ---------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@on_virtual_time
async def test_a_stream_that_slows_to_a_crawl_is_continued_on_hosted(fmt, metric):
    # Cold (nothing learned): the local tower's limit is 2 tokens/s; at 30 tokens it
    # slows to one every 0.8 s (1.25 a second).
    script, slowed = slowing(fmt, after=30, every=0.8)
    asked: list[float] = []
    saturated = metric("tierchain_backend_saturated_total", route="echo", backend="tower")
    async with gateway(script, timed_finisher(fmt, asked)) as (url, _, hosted):
        assert await read_with_sdk(fmt, url) == FULL
        partial = partial_of(fmt, json.loads(posts(hosted)[-1].body))
    assert 30 <= len(partial.split()) <= 38
    # Two spans of 2 s under the limit: hosted is asked 2 to 6 s after the slowdown.
    assert 2.0 < asked[0] - slowed[0] < 6.0
    after = metric("tierchain_backend_saturated_total", route="echo", backend="tower")
    assert after == saturated + 1


@on_virtual_time
async def test_the_caller_reads_why_the_answer_moved_before_it_is_continued():
    script, _ = slowing("chat", after=30, every=0.8)
    async with gateway(script, finisher("chat")) as (url, _, _h):
        content = await raw("chat", url)
    starved = content.index(STARVED)
    assert b'"limit_tokens_per_s":2.0,"failing_over":true}' in content
    assert starved < content.index(b'"state":"continuing"')
    assert content.count(b"data: [DONE]") == 1


@on_virtual_time
async def test_a_learned_normal_moves_a_stream_that_falls_to_a_fifth_of_it():
    # Five healthy streams at 20 tokens/s teach the tower's normal (limit: 5 tokens/s);
    # then one slows to 4 tokens/s, above the cold 2 but under a quarter of its normal.
    healthy, _ = slowing("chat", after=-1, every=0.05)
    script, slowed = slowing("chat", after=20, every=0.25)
    served = 0

    async def tower(ex: Exchange) -> Any:
        nonlocal served
        if ex.request.method == "POST":
            served += 1
        return await (healthy if served <= 5 else script)(ex)

    asked: list[float] = []
    async with gateway(tower, timed_finisher("chat", asked)) as (url, _, _h):
        for _ in range(5):
            assert await read_with_sdk("chat", url) == FULL
        assert asked == []
        assert await read_with_sdk("chat", url) == FULL
    assert len(asked) == 1
    assert 2.0 < asked[0] - slowed[0] < 6.0


# -- and what is never cut for it ----------------------------------------------------------


@on_virtual_time
async def test_the_last_tier_is_never_cut_for_its_rate():
    script, _ = slowing("chat", after=5, every=0.8)
    async with FakeBackend("tower", script) as t:
        routes = Routes({"echo": [Backend("tower", t.url, regime="local")]})
        forwarder = Forwarder()
        watchdog = SaturationWatchdog(forwarder)
        async with serve(Failover(watchdog, routes=routes)) as url:
            content = await raw("chat", url)
        await forwarder.aclose()
        await watchdog.aclose()
    assert content.endswith(b"data: [DONE]\n\n")
    assert b"backend_starved" not in content
    assert b"error" not in content


@on_virtual_time
async def test_a_stream_that_cannot_be_continued_is_not_cut_for_its_rate():
    script, _ = slowing("chat", after=5, every=0.8)
    async with FakeBackend("tower", script) as t, FakeBackend("h", finisher("chat")) as h:
        chain = [Backend("tower", t.url, regime="local"), Backend("hosted", h.url)]
        routes = Routes({"echo": chain}, continuations={"echo": 0})
        forwarder = Forwarder()
        watchdog = SaturationWatchdog(forwarder)
        async with serve(Failover(watchdog, routes=routes)) as url:
            content = await raw("chat", url)
        await forwarder.aclose()
        await watchdog.aclose()
        assert posts(h) == []
    assert content.endswith(b"data: [DONE]\n\n")


@on_virtual_time
async def test_a_pause_of_a_few_seconds_then_the_normal_rate_is_not_starved():
    events, opening = stream_of("chat", TOKENS, tier="tower")

    async def pausing(ex: Exchange) -> None:
        await ex.head(200)
        for n, event in enumerate(events):
            await ex.write(event)
            # Another slot's prompt batch: 3 s of nothing, 20 tokens in (the stall
            # window is 8 s, cold).
            await asyncio.sleep(3.0 if n == opening + 20 else 0.05)
        await ex.end()

    async with gateway(pausing, finisher("chat"), stall_after=None) as (url, _, hosted):
        content = await raw("chat", url)
        assert posts(hosted) == []
    assert b"backend_starved" not in content


def test_a_silent_stream_is_left_to_the_stall_window():
    # (tests/test_shared_normals.py: a cold gateway's stalled local stream is cut at 8 s,
    # its stall window, not at the decode rate's 4 s.)
    assert LearnedGap().window_for("tower", "local")[0] == COLD["local"].stall > 2 * 2.0


# -- made and armed only for a request that lives ---------------------------------------


def counting_decode_watches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, float]]:
    """Each decode watch the watchdog makes: (when it was made, its first tick's due time
    minus its stream's first data event)."""
    made: list[tuple[float, float]] = []

    class Counted(DecodeWatch):
        __slots__ = ()

        def __init__(self, watch: Any, normal: Any, backend: Any, at: float, events: int) -> None:
            super().__init__(watch, normal, backend, at, events)
            assert self._handle is not None
            made.append((now(), deadlines.due(self._handle) - at))

    monkeypatch.setattr(tierchain.watch, "DecodeWatch", Counted)
    return made


def first_then(pause: float) -> Any:
    """A backend handler: one data event at once, then ``pause`` seconds, then [DONE]."""

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        start = {"type": "http.response.start", "status": 200}
        await send({**start, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await asyncio.sleep(pause)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return handler


@on_virtual_time
async def test_a_stream_over_before_its_request_has_run_watch_after_makes_no_decode_watch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = counting_decode_watches(monkeypatch)
    await one_request(whole_stack(first_then(WATCH_AFTER / 2)))
    assert made == []


@on_virtual_time
async def test_a_stream_that_commits_young_and_lives_on_is_judged_from_its_first_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = counting_decode_watches(monkeypatch)
    started = now()
    await one_request(whole_stack(first_then(1.0)))
    # Made when the request had run WATCH_AFTER, its first span timed from the first event.
    assert len(made) == 1
    assert made[0][0] == pytest.approx(started + WATCH_AFTER, abs=2e-3)
    assert made[0][1] == pytest.approx(DecodeRate().span)


@on_virtual_time
async def test_a_watch_over_before_its_request_has_run_watch_after_arms_no_timer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    armed: list[float] = []
    arm = tierchain.watch.Watch._arm

    def counted(self: Any, delay: float, *, fixed: bool) -> None:
        armed.append(now() + delay)
        arm(self, delay, fixed=fixed)

    monkeypatch.setattr(tierchain.watch.Watch, "_arm", counted)
    await one_request(whole_stack(first_then(WATCH_AFTER / 2)))
    assert armed == []
    # One that lives on: its timer is armed once it has run WATCH_AFTER, for what is due
    # then (the stall window's end after its last event: later than its window's).
    started = now()
    await one_request(whole_stack(first_then(1.0)))
    assert len(armed) >= 1
    assert armed[0] > started + WATCH_AFTER
