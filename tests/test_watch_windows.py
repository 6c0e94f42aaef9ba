"""One attempt's watch, point by point, on the virtual clock (docs/watchdog.md): which of the
four points that bound the wait for a first chunk comes first (the window's end, the
expected prefill, the reserve's point, the ceiling) and what the watch says there, that the
request's own deadline is no saturation, the last tier's slow line instead of a cut, and a
committed stream's stall window.

Each watch times a task of its own (a watch cuts the task it was begun in); the keeper is a
real SaturationWatchdog, the request and attempt are Failover's types, and every time below
is exact.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import pytest

from tierchain import SaturationWatchdog
from tierchain._disconnect import WATCH_AFTER
from tierchain.errors import BackendBusy
from tierchain.watch import Watch

from .support import now, on_virtual_time
from .watch_rig import MORE, _nothing, commit, cut_at, keeper, lane, run, watch_of


@on_virtual_time
async def test_a_quiet_attempt_without_a_status_url_is_cut_at_its_windows_end():
    assert await cut_at(watch_of()) == ("no_first_chunk", 10.0)


@on_virtual_time
async def test_no_window_leaves_the_ceiling():
    assert await cut_at(watch_of(window=0.0, ceiling=45.0)) == ("ceiling", 45.0)


@on_virtual_time
async def test_the_expected_prefill_ending_first_is_too_slow_and_the_attempts_verdict():
    watch = watch_of(prefill=4.0)
    assert await cut_at(watch) == ("too_slow", 4.0)
    assert watch.attempt is not None
    assert watch.attempt.verdict == "too_slow"
    assert await cut_at(watch_of(prefill=4.0, first_token=True)) == ("first_token", 4.0)


@on_virtual_time
async def test_the_ceiling_ending_first_is_the_ceiling():
    assert await cut_at(watch_of(ceiling=6.0, prefill=8.0)) == ("ceiling", 6.0)


@on_virtual_time
async def test_the_reserves_point_ending_first_cuts_there_for_the_next_tier():
    watch = watch_of(deadline=now() + 30.0, reserve=25.0, prefill=8.0)
    assert await cut_at(watch) == ("reserve", 5.0)


@on_virtual_time
async def test_the_requests_deadline_before_every_point_is_no_saturation():
    watch = watch_of(deadline=now() + 10.0)  # the window ends at the deadline itself
    assert await cut_at(watch, within=100.0) == (None, 100.0)
    watch = watch_of(deadline=now() + 10.5)
    assert await cut_at(watch) == ("no_first_chunk", 10.0)


@on_virtual_time
async def test_an_attempt_whose_reserves_point_has_passed_is_busy_before_it_goes():
    watch = watch_of(deadline=now() + 5.0, reserve=5.0)
    with pytest.raises(BackendBusy) as busy:
        watch.begin()
    assert busy.value.why == "reserve"
    assert str(busy.value) == "no time left for backend 'tower' before the reserve"
    watch = watch_of(deadline=now() + 5.001, reserve=5.0)
    assert await cut_at(watch) == ("reserve", pytest.approx(0.001))


@on_virtual_time
async def test_the_last_tier_is_never_cut_at_its_window_only_said_slow_then_the_ceiling(caplog):
    lines: list[dict[str, Any]] = []
    watch = watch_of(last=True, ceiling=40.0, lines=lines)
    with caplog.at_level(logging.WARNING, logger="tierchain"):
        assert await cut_at(watch) == ("ceiling", 40.0)
    assert lines == [
        {"state": "backend_slow", "backend": "hosted", "waited_s": 10.0, "failing_over": False}
    ]
    (slow,) = [r for r in caplog.records if getattr(r, "event", None) == "dispatch.backend_slow"]
    assert slow.tierchain == {
        "route": "echo",
        "backend": "hosted",
        "waited_s": 10.0,
        "window_s": 10.0,
        "last_tier": True,
    }


@on_virtual_time
async def test_the_watch_points_in_order():
    t0 = now()
    watch = watch_of(deadline=t0 + 100.0, reserve=20.0, prefill=30.0, ceiling=50.0)
    assert watch._due() == t0 + 10.0
    assert watch._due(window=False) == t0 + 30.0
    assert watch._end() == t0 + 50.0
    watch = watch_of(deadline=t0 + 100.0, reserve=60.0, prefill=math.inf, window=0.0)
    assert watch._due() == t0 + 40.0
    assert watch._end() == t0 + 40.0
    watch = watch_of(deadline=t0 + 30.0)
    assert watch._end() == t0 + 30.0
    assert watch._due(window=False) == math.inf  # the ceiling comes after the deadline
    assert watch_of()._end() == t0 + 600.0


@on_virtual_time
async def test_a_committed_stream_silent_for_its_stall_window_is_stalled(caplog):
    async def stream(watch: Watch) -> None:
        await asyncio.sleep(1.0)
        commit(watch)
        await asyncio.sleep(2.5)
        watch.observer.body(MORE)  # 3.5 s: the gap starts again

    with caplog.at_level(logging.WARNING, logger="tierchain"):
        assert await run(watch_of(stall=3.0), stream) == ("stalled", pytest.approx(6.5))
    (line,) = [r for r in caplog.records if getattr(r, "event", None) == "dispatch.backend_stalled"]
    assert line.tierchain == {
        "route": "echo",
        "backend": "tower",
        "idle_s": 3.0,
        "stall_after_s": 3.0,
    }


@on_virtual_time
async def test_a_stream_the_caller_was_slow_to_take_is_quiet_only_since_it_took_it():
    async def stream(watch: Watch) -> None:
        commit(watch)
        await asyncio.sleep(2.0)
        assert watch.req is not None
        watch.req.caller_unblocked_at = now()  # the caller took our last send back only now

    # 3 s after the caller took it, not after 3 s
    assert await run(watch_of(stall=3.0), stream) == ("stalled", pytest.approx(5.0))


@on_virtual_time
async def test_a_committed_stream_without_a_stall_window_is_never_cut():
    # (its reserve's point passes too: a stream that cannot be continued runs on)
    watch = watch_of(stall=0.0, deadline=now() + 30.0, reserve=25.0)

    async def stream(watch: Watch) -> None:
        commit(watch)
        await asyncio.sleep(6.0)
        assert watch._handle is None  # past the reserve's point: no timer left at all

    assert await run(watch, stream, within=500.0) == (None, 506.0)


@on_virtual_time
async def test_a_stall_window_under_a_second_is_timed_from_the_last_event():
    async def stream(watch: Watch) -> None:
        commit(watch)
        await asyncio.sleep(0.3)
        watch.observer.body(MORE)

    assert await run(watch_of(stall=0.5), stream) == ("stalled", pytest.approx(0.8))


@on_virtual_time
async def test_a_continuable_stream_is_cut_at_the_reserves_point_before_its_stall_window():
    watch = watch_of(stall=2.0, deadline=now() + 30.0, reserve=25.0, continuable=True)
    assert watch.req is not None

    async def stream(watch: Watch) -> None:
        commit(watch)
        for gap in (1.5, 1.7):  # at 1.5 s and 3.2 s: each gap under the stall window
            await asyncio.sleep(gap)
            watch.observer.body(MORE)
        # quiet until 5.2 s, but the reserve's point is at 5 s

    assert await run(watch, stream) == ("reserve", pytest.approx(5.0))


@on_virtual_time
async def test_a_held_answers_first_bytes_do_not_end_its_window():
    # (a held answer is answered when whole: its window runs on, no stall window starts)
    async def first_bytes(watch: Watch) -> None:
        await asyncio.sleep(3.0)
        watch.observer.start(200, [(b"content-type", b"application/json")])
        watch.observer.body(b'{"id": "chatcmpl-1", "choices": [')
        watch.first_data()

    assert await run(watch_of(stall=2.0), first_bytes) == ("incomplete", 10.0)


@on_virtual_time
async def test_a_stream_with_a_later_tier_is_judged_for_its_decode_rate_from_its_first_event():
    # a token a second against a limit of 12.5 (a quarter of 50 tokens/s): two 2 s spans
    # below it from the first event at 1 s, starved at 5 s
    async def crawling(watch: Watch) -> None:
        await asyncio.sleep(1.0)
        commit(watch)
        for _ in range(10):
            await asyncio.sleep(1.0)
            watch.observer.body(MORE)

    watch = watch_of(watchdog=keeper(decode_rate=50.0), continuable=True)
    assert watch.req is not None
    assert await run(watch, crawling) == ("slow_decode", 5.0)
    last = watch_of(last=True, watchdog=keeper(decode_rate=50.0), continuable=True)
    assert last.req is not None
    assert await run(last, crawling, within=0.0) == (None, 11.0)  # the last tier: never


@on_virtual_time
async def test_a_streams_first_event_is_its_answer_before_failover_sends_it_on():
    # (a framed stream: its stall window runs from its first event, committed or not)
    async def first_event(watch: Watch) -> None:
        await asyncio.sleep(1.0)
        watch.observer.start(200, [(b"content-type", b"text/event-stream")])
        watch.observer.body(MORE)
        watch.first_data()

    assert await run(watch_of(stall=3.0), first_event) == ("stalled", 4.0)


@on_virtual_time
async def test_a_held_answer_failover_sent_on_is_answered_and_then_stalls():
    # its first bytes at 3 s, sent on to the caller: at the window's end it is a stream
    # quiet for longer than its stall window, not an answer that never came
    async def sent_on(watch: Watch) -> None:
        assert watch.req is not None
        await asyncio.sleep(3.0)
        watch.observer.start(200, [(b"content-type", b"application/json")])
        watch.observer.body(b'{"id": "chatcmpl-1", "choices": [')
        watch.req.committed = True
        watch.first_data()

    assert await run(watch_of(stall=2.0), sent_on) == ("stalled", 10.0)


def _timers(t0: float) -> list[float]:
    """The loop's pending deadlines, as seconds after ``t0``."""
    from tierchain._runtime import deadlines

    return sorted(deadlines.due(d) - t0 for d in deadlines._TIMERS.get().pending.values())


@on_virtual_time
async def test_a_watch_keeps_one_timer_at_a_time_from_its_first_event():
    seen: list[list[float]] = []

    def first_event_at(at: float) -> Any:
        async def stream(watch: Watch) -> None:
            t0 = now()
            await asyncio.sleep(at)
            commit(watch)
            seen.append(_timers(t0))

        return stream

    # the window's timer (10 s) gives way to the stall window's (1 + 3 s)
    await run(watch_of(stall=3.0), first_event_at(1.0))
    # the window's timer comes first: kept (no second timer at 10.1 s)
    await run(watch_of(stall=0.5), first_event_at(9.6))
    # the reserve's point (5 s) before the stall window's end (11 s): its timer is kept
    watch = watch_of(stall=10.0, deadline=now() + 30.0, reserve=25.0, continuable=True)
    assert watch.req is not None
    await run(watch, first_event_at(1.0))
    # no stall window, no reserve: no timer at all
    await run(watch_of(stall=0.0), first_event_at(1.0), within=1.0)
    # no stall window: the reserve's point (5 s) is still looked at
    watch = watch_of(stall=0.0, deadline=now() + 30.0, reserve=25.0, continuable=True)
    await run(watch, first_event_at(1.0))
    # a stall window (1 + 0.5 s) ending before the reserve's point (5 s): its timer instead
    watch = watch_of(stall=0.5, deadline=now() + 30.0, reserve=25.0, continuable=True)
    await run(watch, first_event_at(1.0))
    assert seen == [[4.0], [10.0], [5.0], [], [5.0], [1.5]]
    assert _timers(now()) == []  # and none left once the attempts ended


@on_virtual_time
async def test_a_recurring_delay_waits_in_its_lane_and_a_one_off_point_in_the_heap():
    # (a lane is a queue of equal delays: no heap push for the delays most attempts share)
    lanes: list[float | str | None] = []

    async def look(watch: Watch) -> None:
        lanes.append(lane(watch))

    await run(watch_of(), look, within=0.0)  # a configured window: 10 s
    await run(watch_of(window=0.0, ceiling=45.0), look, within=0.0)  # the ceiling
    await run(watch_of(deadline=now() + 30.0, reserve=25.0), look, within=0.0)  # a point
    await run(watch_of(prefill=4.0, first_token=True), look, within=0.0)  # the backend's own
    await run(watch_of(prefill=4.0), look, within=0.0)  # this prompt's expected prefill
    computed = SaturationWatchdog(_nothing, slow_after=lambda body: 10.0, prompt_rate=0)
    await run(watch_of(watchdog=computed), look, within=0.0)  # a window computed per request
    rated = keeper(prompt_rate=100.0)  # its floor (2 s), the limit of most short prompts
    await run(watch_of(prefill=2.0, watchdog=rated), look, within=0.0)

    async def stream(watch: Watch) -> None:
        assert watch.req is not None
        commit(watch)
        lanes.append(lane(watch))  # the stall window: 3 s
        await asyncio.sleep(0.5)
        watch.observer.body(MORE)
        await asyncio.sleep(2.6)  # looked at 3 s: quiet only since 0.5 s
        lanes.append(lane(watch))  # the rest of the gap: a one-off
        watch.req.caller_blocked_since = now()
        await asyncio.sleep(0.5)  # looked at 3.5 s: the caller is not reading
        lanes.append(lane(watch))  # one stall window later

    await run(watch_of(stall=3.0), stream, within=0.0)
    assert lanes == [10.0, 45.0, "heap", 4.0, "heap", "heap", 2.0, 3.0, "heap", 3.0]


async def _young(
    watch: Watch, first_event_at: float | None
) -> tuple[str | None, float, list[float], list[str]]:
    """The attempt of a request in its first ``WATCH_AFTER`` seconds, as Failover runs it:
    the request's disconnect guard entered first, the attempt's own span current inside
    it. (Why the watch fired and when, the pending deadlines just after the first data
    event, and the names of the attempt span's events.)"""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tierchain._disconnect import DisconnectGuard

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    at_first: list[float] = []
    t0 = now()

    async def host_receive() -> Any:
        await asyncio.Event().wait()  # the caller stays

    async def attempt() -> None:
        async with DisconnectGuard(host_receive) as guard:
            assert watch.req is not None
            watch.req.guard = guard
            with provider.get_tracer("t").start_as_current_span("attempt"):
                watch.begin()
                if first_event_at is not None:
                    await asyncio.sleep(first_event_at)
                    commit(watch)
                    at_first.extend(_timers(t0))
                await asyncio.sleep(3600)

    task = asyncio.create_task(attempt())
    with pytest.raises(asyncio.CancelledError):
        await task  # the watch cut it
    took = now() - t0
    watch.end()
    (span,) = exporter.get_finished_spans()
    return watch.fired, took, at_first, [event.name for event in span.events]


@on_virtual_time
async def test_a_young_requests_stall_window_is_armed_when_the_request_is_20ms_old():
    # A first data event 5 ms in: the stall window (3 s) is armed at the young phase's
    # end (20 ms), not at the first event, for the very time it would have had, and
    # judged in the attempt's own context (its span gets the stall's event).
    fired, took, at_first, events = await _young(watch_of(stall=3.0), 0.005)
    assert at_first == [pytest.approx(WATCH_AFTER)]  # the young phase's end alone
    assert (fired, took) == ("stalled", pytest.approx(3.005, abs=1e-6))
    assert "tierchain.backend_stalled" in events


@on_virtual_time
async def test_a_young_requests_reserve_point_is_armed_when_the_request_is_20ms_old():
    # No stall window, a reserve's point 5 s in: nothing armed at the first data event
    # (5 ms) but the young phase's end, and the stream cut at its reserve's point.
    watch = watch_of(stall=0.0, deadline=now() + 30.0, reserve=25.0, continuable=True)
    fired, took, at_first, _ = await _young(watch, 0.005)
    assert at_first == [pytest.approx(WATCH_AFTER)]
    assert (fired, took) == ("reserve", pytest.approx(5.0, abs=1e-6))


@on_virtual_time
async def test_a_stall_window_shorter_than_the_young_phase_is_timed_from_the_first_event():
    fired, took, at_first, _ = await _young(watch_of(stall=0.01), 0.005)
    assert at_first == [pytest.approx(0.015), pytest.approx(WATCH_AFTER)]
    assert (fired, took) == ("stalled", pytest.approx(0.015, abs=1e-6))


@on_virtual_time
async def test_a_window_shorter_than_the_young_phase_is_timed_from_the_start():
    fired, took, _, _ = await _young(watch_of(window=0.01), None)
    assert (fired, took) == ("no_first_chunk", pytest.approx(0.01, abs=1e-6))
