"""The shared deadline queue: what fires, when, and what a cancel prevents."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import inspect
import time
import weakref
from collections.abc import Callable

import pytest

from tierchain._runtime import deadlines as _deadlines

from .support import busy_for, now, on_virtual_time

TICK = 0.02  # seconds; several times asyncio's own timer slack


@on_virtual_time
async def test_deadlines_fire_in_due_order_across_recurring_and_one_off_delays():
    fired: list[str] = []
    _deadlines.schedule(2 * TICK, lambda: fired.append("fixed 2"))
    _deadlines.schedule(TICK, lambda: fired.append("fixed 1"))
    _deadlines.schedule(1.5 * TICK, lambda: fired.append("one-off 1.5"), fixed=False)
    _deadlines.schedule(2 * TICK, lambda: fired.append("fixed 2, later"))
    await asyncio.sleep(3 * TICK)
    assert fired == ["fixed 1", "one-off 1.5", "fixed 2", "fixed 2, later"]


@on_virtual_time
async def test_deadlines_that_fall_due_in_one_late_wake_still_fire_in_due_order():
    fired: list[str] = []
    _deadlines.schedule(2 * TICK, lambda: fired.append("fixed 2"))
    _deadlines.schedule(TICK, lambda: fired.append("fixed 1"))
    _deadlines.schedule(1.5 * TICK, lambda: fired.append("one-off 1.5"), fixed=False)
    busy_for(3 * TICK)  # the loop is blocked: all of them fall due at once
    await asyncio.sleep(TICK)
    assert fired == ["fixed 1", "one-off 1.5", "fixed 2"]


@on_virtual_time
async def test_a_cancelled_deadline_never_fires_and_the_rest_still_do():
    fired: list[int] = []
    entries = [_deadlines.schedule(TICK, lambda n=n: fired.append(n)) for n in range(5)]
    _deadlines.cancel(entries[0])  # the one the loop timer was armed for
    _deadlines.cancel(entries[3])
    _deadlines.cancel(None)  # a no-op
    await asyncio.sleep(2 * TICK)
    assert fired == [1, 2, 4]
    _deadlines.cancel(entries[1])  # after it fired: a no-op
    assert fired == [1, 2, 4]


@on_virtual_time
async def test_a_deadline_fires_no_earlier_than_its_delay():
    fired_at: list[float] = []
    start = now()
    entry = _deadlines.schedule(TICK, lambda: fired_at.append(now()))
    assert _deadlines.due(entry) >= start + TICK
    await asyncio.sleep(3 * TICK)
    assert len(fired_at) == 1
    assert fired_at[0] == pytest.approx(start + TICK, abs=1e-6)  # not early, not late


@on_virtual_time
async def test_cancelled_entries_do_not_pile_up_in_a_recurring_delays_queue():
    # 5,000 requests answered long before their 60 s deadline: what stays queued is
    # bounded by the compaction (twice the live entries, at least 1,024), not 5,000.
    delay = 60.0 + TICK  # a delay of this test's own
    live = [_deadlines.schedule(delay, lambda: None) for _ in range(10)]
    for _ in range(5_000):
        _deadlines.cancel(_deadlines.schedule(delay, lambda: None))
    timers = _deadlines._TIMERS.get()
    queued = timers.fifos[delay].seqs
    assert len(queued) <= 1_024
    assert all(entry.seq in queued for entry in live)
    for entry in live:
        _deadlines.cancel(entry)


@on_virtual_time
async def test_a_callback_runs_in_the_context_it_was_scheduled_with():
    var: contextvars.ContextVar[str] = contextvars.ContextVar("request")
    var.set("request-7")
    seen: list[str] = []
    _deadlines.schedule(
        TICK, lambda: seen.append(var.get("none")), context=contextvars.copy_context()
    )
    _deadlines.schedule(TICK, lambda: seen.append(var.get("none")))  # no context: the timer's own
    await asyncio.sleep(2 * TICK)
    assert seen == ["request-7", "none"]


@on_virtual_time
async def test_one_broken_callback_does_not_stop_the_others():
    fired: list[str] = []
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))

    def broken() -> None:
        raise RuntimeError("boom")

    _deadlines.schedule(TICK, broken)
    _deadlines.schedule(TICK, lambda: fired.append("after"))
    await asyncio.sleep(2 * TICK)
    assert fired == ["after"]
    assert [str(e["exception"]) for e in errors] == ["boom"]


@on_virtual_time
async def test_cancelled_one_off_deadlines_do_not_pile_up_in_the_heap():
    live = _deadlines.schedule(60.0, lambda: None, fixed=False)
    for n in range(5_000):  # header budgets, learned windows: a different delay each time
        _deadlines.cancel(_deadlines.schedule(30.0 + n * 1e-3, lambda: None, fixed=False))
    heap = _deadlines._TIMERS.get().heap
    assert len(heap) <= 1_024
    assert (live.due, live.seq) in heap
    _deadlines.cancel(live)


def test_the_timers_of_closed_event_loops_are_let_go():
    async def one() -> None:
        _deadlines.cancel(_deadlines.schedule(10.0, lambda: None))

    for _ in range(30):
        asyncio.run(one())
    assert len(_deadlines._TIMERS) <= 9


@on_virtual_time
async def test_a_cancelled_deadline_is_not_kept_by_the_queue_until_it_falls_due():
    # What a request scheduled and cancelled is freed with the request: left in a queue
    # for its 60 s, such entries pile up in the collector's oldest generation, and its
    # full passes then cost every request.
    class Callback:
        def __call__(self) -> None:
            pass

    callback = Callback()
    entry = _deadlines.schedule(60.0, callback)
    _deadlines.cancel(entry)
    gone = weakref.ref(callback)
    del callback
    assert gone() is None
    holders = [r for r in gc.get_referrers(entry) if not inspect.iscoroutine(r)]
    assert holders == []  # (the test's own frame aside): no queue holds the entry
    timers = _deadlines._TIMERS.get()
    assert all(not gc.is_tracked(x) for fifo in timers.fifos.values() for x in fifo.dues)


def test_the_one_tolerance_covers_how_early_the_event_loop_may_run_a_timer():
    # asyncio runs the timers due within its clock's resolution (a hair early); the
    # scheduler's tolerance must be at least that, or a wake would find nothing due.
    assert time.get_clock_info("monotonic").resolution <= _deadlines.EARLY
    assert _deadlines.EARLY <= 0.001  # and small beside any window it is used for


@on_virtual_time
async def test_what_falls_due_within_the_tolerance_of_a_wake_is_called_in_that_wake():
    # Thousands of keepalives spread over an interval wake the loop about once per EARLY,
    # not once each: a wake takes along what falls due within the tolerance.
    start = now()
    fired: list[tuple[str, float]] = []
    _deadlines.schedule(TICK, lambda: fired.append(("due", now() - start)))
    _deadlines.schedule_at(
        start + TICK + _deadlines.EARLY / 2, lambda: fired.append(("within", now() - start))
    )
    _deadlines.schedule_at(
        start + TICK + 2 * _deadlines.EARLY, lambda: fired.append(("after", now() - start))
    )
    await asyncio.sleep(2 * TICK)
    assert [name for name, _ in fired] == ["due", "within", "after"]
    assert fired[0][1] == pytest.approx(TICK, abs=1e-9)
    assert fired[1][1] == pytest.approx(TICK, abs=1e-9)  # the same wake, half EARLY early
    assert fired[2][1] == pytest.approx(TICK + 2 * _deadlines.EARLY, abs=1e-9)  # its own


@on_virtual_time
async def test_an_entry_out_of_order_in_its_lane_goes_to_the_heap_and_fires_in_due_order():
    # A stream's next keepalive is its last output plus the interval: mostly in order
    # (its lane's FIFO), but one whose last output was earlier than the last queued
    # must not wait behind it.
    start = now()
    fired: list[str] = []
    late = _deadlines.schedule_at(start + 3 * TICK, lambda: fired.append("3"), lane=TICK)
    early = _deadlines.schedule_at(start + 2 * TICK, lambda: fired.append("2"), lane=TICK)
    timers = _deadlines._TIMERS.get()
    assert list(timers.fifos[TICK].seqs) == [late.seq]
    assert (early.due, early.seq) in timers.heap
    await asyncio.sleep(4 * TICK)
    assert fired == ["2", "3"]


@on_virtual_time
async def test_the_lag_monitor_ticks_on_the_scheduler_and_sees_a_blocked_loop():
    from tierchain._runtime import lag

    start = now()
    assert lag.lag_since(start) == 0.0  # not watched in this loop yet
    lag.watch()
    lag.watch()  # once per loop
    await asyncio.sleep(4.5 * lag.PERIOD)  # ticks on time at 1, 2, 3 and 4 periods
    assert lag.lag_since(start) == pytest.approx(0.0, abs=1e-9)
    busy_for(6 * lag.PERIOD)  # the tick due at 5 periods runs at 10.5
    assert lag.lag_since(start) == pytest.approx(5.5 * lag.PERIOD, abs=1e-9)  # overdue now
    await asyncio.sleep(0)
    assert lag.lag_since(start) == pytest.approx(5.5 * lag.PERIOD, abs=1e-9)  # as it ran
    assert lag.lag_since(now()) == pytest.approx(5.5 * lag.PERIOD, abs=1e-9)  # just now
    await asyncio.sleep(3 * lag.PERIOD)
    assert lag.lag_since(now() - lag.PERIOD) == pytest.approx(0.0, abs=1e-9)  # on time again
    timers = _deadlines._TIMERS.get()
    assert any(e.callback == lag._MONITORS.get()._tick for e in timers.pending.values())


@on_virtual_time
async def test_the_lag_monitor_ticks_only_while_a_connection_set_up_holds_it():
    from tierchain._runtime import lag

    def ticking() -> bool:
        timers = _deadlines._TIMERS.get()
        return any(e.callback == lag._MONITORS.get()._tick for e in timers.pending.values())

    start = now()
    lag.hold()
    lag.hold()  # two set-ups under way
    assert ticking()
    await asyncio.sleep(2.5 * lag.PERIOD)
    lag.release()
    busy_for(3 * lag.PERIOD)  # the one still held sees the loop run late
    # The tick due at 3 periods is overdue at 5.5.
    assert lag.lag_since(start) == pytest.approx(2.5 * lag.PERIOD, abs=1e-9)
    lag.release()  # none held: the next tick is the last
    await asyncio.sleep(0)
    await asyncio.sleep(2 * lag.PERIOD)
    assert not ticking()
    busy_for(10 * lag.PERIOD)  # stopped: no tick is overdue, and what was seen is kept
    assert lag.lag_since(start) == pytest.approx(2.5 * lag.PERIOD, abs=1e-9)
    assert lag.lag_since(now()) == 0.0
    lag.hold()  # a new set-up starts the ticks again
    assert ticking()
    lag.release()


@on_virtual_time
async def test_a_loose_lane_joins_a_wake_made_anyway_and_alone_fires_on_time():
    fired: list[tuple[str, float]] = []

    def note(name: str) -> Callable[[], None]:
        return lambda: fired.append((name, now()))

    start = now()
    lane, slack = 10.0, 0.2
    # Alone: at its own time, not earlier.
    _deadlines.schedule_at(start + lane, note("alone"), lane=lane, slack=slack)
    await asyncio.sleep(lane + 1)
    assert fired == [("alone", pytest.approx(start + lane))]
    # Two loose entries within the slack of the first: one wake calls all three (the
    # later two early); one beyond the slack gets a wake of its own, on time.
    fired.clear()
    t = now()
    _deadlines.schedule_at(t + 1.0, note("first"), lane=lane, slack=slack)
    _deadlines.schedule_at(t + 1.1, note("early"), lane=lane, slack=slack)
    _deadlines.schedule_at(t + 1.2, note("edge"), lane=lane, slack=slack)
    _deadlines.schedule_at(t + 1.5, note("own"), lane=lane, slack=slack)
    # A plain entry of the same delay is no part of the loose lane.
    _deadlines.schedule_at(t + 1.05, note("strict"), lane=1.05)
    await asyncio.sleep(2)
    assert fired == [
        ("first", pytest.approx(t + 1.0)),
        ("early", pytest.approx(t + 1.0)),
        ("edge", pytest.approx(t + 1.0)),
        ("strict", pytest.approx(t + 1.05)),
        ("own", pytest.approx(t + 1.5)),
    ]
