"""The breaker ledgers and pins: the same semantics from MemoryStore and RedisStore."""

from __future__ import annotations

import asyncio

import pytest

from tierchain.store import BreakerPolicy, BreakerSnapshot, Store

POLICY = BreakerPolicy(
    failure_threshold=5,
    failure_cooldown=30.0,
    saturation_threshold=2,
    saturation_cooldown=900.0,
    retry_after_cap=120.0,
    probe_lease=60.0,
)
R, B = "echo", "tower"


@pytest.fixture
def clock(manual_clock):
    return manual_clock


@pytest.fixture
def store(breaker_store):
    return breaker_store


async def fail(store: Store, outcome: str = "failure", times: int = 1, **kw) -> None:
    for _ in range(times):
        ticket = await store.breaker_acquire(R, B, POLICY)
        await store.breaker_record(R, B, POLICY, outcome, gen=ticket.gen, **kw)


async def test_a_breaker_never_seen_is_closed(store):
    assert await store.breaker_snapshot(R, B) == BreakerSnapshot("closed", None, 0, 0)
    ticket = await store.breaker_acquire(R, B, POLICY)
    assert ticket.admitted
    assert ticket.clean


async def test_five_consecutive_failures_open_for_the_failure_cooldown(store, clock):
    await fail(store, times=4)
    assert (await store.breaker_snapshot(R, B)).state == "closed"
    await fail(store)
    snap = await store.breaker_snapshot(R, B)
    assert snap.state == "open"
    assert snap.failures == 5
    assert snap.retry_in == pytest.approx(30.0, abs=0.01)
    clock.advance(10)
    ticket = await store.breaker_acquire(R, B, POLICY)
    assert not ticket.admitted
    assert ticket.retry_in == pytest.approx(20.0, abs=0.01)


async def test_saturations_count_and_cool_down_apart_from_failures(store):
    await fail(store, times=4)
    await fail(store, "saturation")
    assert (await store.breaker_snapshot(R, B)).state == "closed"
    await fail(store, "saturation")
    snap = await store.breaker_snapshot(R, B)
    assert (snap.state, snap.failures, snap.saturations) == ("open", 4, 2)
    assert snap.retry_in == pytest.approx(900.0, abs=0.01)


async def test_one_good_attempt_clears_both_counts(store):
    await fail(store, times=4)
    await fail(store, "saturation")
    ticket = await store.breaker_acquire(R, B, POLICY)
    assert not ticket.clean
    await store.breaker_record(R, B, POLICY, "success", gen=ticket.gen)
    assert await store.breaker_snapshot(R, B) == BreakerSnapshot("closed", None, 0, 0)
    await fail(store, times=4)
    assert (await store.breaker_snapshot(R, B)).state == "closed"


async def test_a_neutral_outcome_counts_nothing_and_clears_nothing(store):
    await fail(store, times=4)
    await fail(store, "neutral")
    assert (await store.breaker_snapshot(R, B)).failures == 4


async def test_after_the_cooldown_exactly_one_probe_goes_and_its_success_closes(store, clock):
    await fail(store, "saturation", times=2)
    clock.advance(900)
    assert (await store.breaker_snapshot(R, B)).state == "half_open"
    probe = await store.breaker_acquire(R, B, POLICY)
    assert probe.admitted
    assert probe.probe
    assert probe.transitions == ("half_open",)
    others = [await store.breaker_acquire(R, B, POLICY) for _ in range(5)]
    assert not any(t.admitted for t in others)
    assert {t.state for t in others} == {"half_open"}
    change = await store.breaker_record(R, B, POLICY, "success", gen=probe.gen, probe=probe.probe)
    assert change.state == "closed"
    assert change.transitions == ("closed",)
    assert (await store.breaker_acquire(R, B, POLICY)).admitted


async def test_a_failed_probe_reopens_for_its_own_ledger_cooldown(store, clock):
    await fail(store, "saturation", times=2)
    clock.advance(900)
    probe = await store.breaker_acquire(R, B, POLICY)
    change = await store.breaker_record(
        R, B, POLICY, "saturation", gen=probe.gen, probe=probe.probe
    )
    assert change.state == "open"
    assert change.transitions == ("open",)
    # a saturated probe re-opens for saturation_backoff first (then doubling), not 900 s
    assert change.retry_in == pytest.approx(30.0, abs=0.01)


async def test_a_repeated_trip_never_shortens_a_cooldown_in_force(store, clock):
    await fail(store, "saturation", times=2)  # open for 900 s
    clock.advance(100)
    forced = await store.breaker_acquire(R, B, POLICY, force=True)
    assert forced.admitted
    change = await store.breaker_record(R, B, POLICY, "failure", gen=forced.gen)
    assert change.state == "open"
    assert change.retry_in == pytest.approx(800.0, abs=0.01)  # not 30


async def test_a_verdict_from_before_the_breaker_opened_neither_closes_nor_extends_it(store, clock):
    early = await store.breaker_acquire(R, B, POLICY)
    await fail(store, "saturation", times=2)
    clock.advance(10)
    change = await store.breaker_record(R, B, POLICY, "success", gen=early.gen)
    assert change.state == "open"
    change = await store.breaker_record(R, B, POLICY, "saturation", gen=early.gen)
    assert change.retry_in == pytest.approx(890.0, abs=0.01)


async def test_retry_after_opens_at_once_for_at_least_that_long_and_is_capped(store, clock):
    await fail(store, retry_after=45.0)
    snap = await store.breaker_snapshot(R, B)
    assert (snap.state, snap.failures) == ("open", 1)
    assert snap.retry_in == pytest.approx(45.0, abs=0.01)
    clock.advance(45)
    probe = await store.breaker_acquire(R, B, POLICY)
    await store.breaker_record(R, B, POLICY, "failure", gen=probe.gen, retry_after=10_000.0)
    assert (await store.breaker_snapshot(R, B)).retry_in == pytest.approx(120.0, abs=0.01)


async def test_a_neutral_probe_gives_its_slot_back(store, clock):
    await fail(store, "saturation", times=2)
    clock.advance(900)
    probe = await store.breaker_acquire(R, B, POLICY)
    assert not (await store.breaker_acquire(R, B, POLICY)).admitted
    await store.breaker_record(R, B, POLICY, "neutral", gen=probe.gen, probe=probe.probe)
    second = await store.breaker_acquire(R, B, POLICY)
    assert second.probe
    assert second.probe != probe.probe


async def test_a_probe_that_never_reports_loses_its_slot_after_the_lease(store, clock):
    await fail(store, "saturation", times=2)
    clock.advance(900)
    lost = await store.breaker_acquire(R, B, POLICY)
    clock.advance(59)
    assert not (await store.breaker_acquire(R, B, POLICY)).admitted
    clock.advance(1)
    second = await store.breaker_acquire(R, B, POLICY)
    assert second.probe
    # The lost probe reporting late does not free the new holder's slot.
    await store.breaker_record(R, B, POLICY, "neutral", gen=lost.gen, probe=lost.probe)
    assert not (await store.breaker_acquire(R, B, POLICY)).admitted


async def test_breakers_are_kept_per_route_and_backend(store):
    await fail(store, "saturation", times=2)
    assert (await store.breaker_snapshot(R, "hosted")).state == "closed"
    assert (await store.breaker_snapshot("deep", B)).state == "closed"
    assert (await store.breaker_acquire("deep:1", "tower:2", POLICY)).admitted


async def test_a_hundred_concurrent_acquires_after_the_cooldown_take_one_probe(store, clock):
    await fail(store, "saturation", times=2)
    clock.advance(900)
    tickets = await asyncio.gather(*(store.breaker_acquire(R, B, POLICY) for _ in range(100)))
    assert sum(t.admitted for t in tickets) == 1
    assert sum(bool(t.probe) for t in tickets) == 1


async def test_pins_set_read_list_and_delete(store):
    assert await store.get_pin(R) is None
    expiry = await store.set_pin(R, "hosted", 60.0)
    assert expiry > 0
    assert await store.get_pin(R) == "hosted"
    pins = await store.list_pins()
    assert set(pins) == {R}
    backend, remaining = pins[R]
    assert backend == "hosted"
    assert 55.0 < remaining <= 60.0
    assert await store.delete_pin(R) is True
    assert await store.delete_pin(R) is False
    assert await store.get_pin(R) is None
    assert await store.list_pins() == {}


async def test_a_pin_expires_by_itself(store):
    await store.set_pin("odd:route/name", "hosted", 0.05)
    assert await store.get_pin("odd:route/name") == "hosted"
    await asyncio.sleep(0.08)
    assert await store.get_pin("odd:route/name") is None
    assert await store.list_pins() == {}


# -- recovery: growing re-open cooldowns, and waking on a status that reports room -------


async def probe(store: Store, outcome: str, **kw) -> object:
    ticket = await store.breaker_acquire(R, B, POLICY)
    assert ticket.admitted
    assert ticket.probe
    return await store.breaker_record(
        R, B, POLICY, outcome, gen=ticket.gen, probe=ticket.probe, **kw
    )


async def test_one_slow_probe_after_a_hiccup_costs_30_seconds_not_15_minutes(store, clock):
    await fail(store, "failure", retry_after=1.0)  # one 503 with Retry-After: 1
    assert (await store.breaker_snapshot(R, B)).retry_in == pytest.approx(1.0, abs=0.01)
    clock.advance(1.5)
    change = await probe(store, "saturation")  # a single slow first token in half-open
    assert change.state == "open"
    assert change.retry_in == pytest.approx(30.0, abs=0.01)


async def test_re_open_cooldowns_double_up_to_the_saturation_cooldown_and_reset_on_close(
    store, clock
):
    await fail(store, "saturation", times=2)  # opened by the threshold: the full cooldown
    assert (await store.breaker_snapshot(R, B)).retry_in == pytest.approx(900.0, abs=0.01)
    seen = []
    for _ in range(7):
        clock.advance(901)
        seen.append(round((await probe(store, "saturation")).retry_in))
    assert seen == [30, 60, 120, 240, 480, 900, 900]
    clock.advance(901)
    assert (await probe(store, "success")).state == "closed"
    await fail(store, "saturation", times=2)
    clock.advance(901)
    assert round((await probe(store, "saturation")).retry_in) == 30  # the streak starts over


async def test_a_backoff_of_zero_keeps_the_full_cooldown(store, clock):
    policy = BreakerPolicy(saturation_backoff=0.0)
    for _ in range(2):
        t = await store.breaker_acquire(R, B, policy)
        await store.breaker_record(R, B, policy, "saturation", gen=t.gen)
    clock.advance(901)
    t = await store.breaker_acquire(R, B, policy)
    change = await store.breaker_record(R, B, policy, "saturation", gen=t.gen, probe=t.probe)
    assert change.retry_in == pytest.approx(900.0, abs=0.01)


async def test_wake_half_opens_a_breaker_open_for_saturation_and_takes_one_probe(store, clock):
    await fail(store, "saturation", times=2)
    clock.advance(5)
    assert not (await store.breaker_acquire(R, B, POLICY)).admitted
    woken = await store.breaker_acquire(R, B, POLICY, wake=True)
    assert woken.admitted
    assert woken.probe
    assert woken.transitions == ("half_open",)
    other = await store.breaker_acquire(R, B, POLICY, wake=True)
    assert not other.admitted  # one probe, not a herd
    await store.breaker_record(R, B, POLICY, "success", gen=woken.gen, probe=woken.probe)
    assert (await store.breaker_snapshot(R, B)).state == "closed"


async def test_wake_does_not_shorten_a_failure_or_retry_after_cooldown(store, clock):
    await fail(store, "failure", times=5)
    assert not (await store.breaker_acquire(R, B, POLICY, wake=True)).admitted
    await store.breaker_record(R, "other", POLICY, "failure", gen=0, retry_after=60.0)
    assert not (await store.breaker_acquire(R, "other", POLICY, wake=True)).admitted


# -- issue 31: mid-stream deaths, recovery probes on a schedule, the skip's reason ----------


async def test_two_mid_stream_deaths_in_a_row_open_where_five_failures_would(store, clock):
    await fail(store, "stream_failure")
    assert (await store.breaker_snapshot(R, B)).state == "closed"
    await fail(store, "failure")  # a refused connect between them: counted, no reset
    await fail(store, "stream_failure")
    snap = await store.breaker_snapshot(R, B)
    assert snap.state == "open"
    assert snap.failures == 3
    assert snap.retry_in == pytest.approx(30.0, abs=0.01)
    skipped = await store.breaker_acquire(R, B, POLICY)
    assert not skipped.admitted
    assert skipped.reason == "stream_failure"


async def test_one_good_attempt_clears_the_mid_stream_count(store):
    await fail(store, "stream_failure")
    await fail(store, "success")
    await fail(store, "stream_failure")
    assert (await store.breaker_snapshot(R, B)).state == "closed"


async def test_a_snapshot_says_what_opened_the_breaker_while_open(store, clock):
    await fail(store, "saturation", times=2)
    snap = await store.breaker_snapshot(R, B)
    assert (snap.state, snap.reason) == ("open", "saturation")
    ticket = await store.breaker_acquire("other", B, POLICY)
    await store.breaker_record("other", B, POLICY, "failure", gen=ticket.gen, retry_after=5.0)
    assert (await store.breaker_snapshot("other", B)).reason == "retry_after"
    clock.advance(5.0)  # its cooldown is over: half-open, no reason shown
    assert await store.breaker_snapshot("other", B) == BreakerSnapshot("half_open", None, 1, 0)
    probe = await store.breaker_acquire("other", B, POLICY)
    assert probe.probe
    # Skipped while that probe is out: still the backend's own Retry-After (a 429 to callers).
    busy = await store.breaker_acquire("other", B, POLICY)
    assert (busy.admitted, busy.state, busy.reason) == (False, "half_open", "retry_after")


async def test_a_failing_breaker_is_probed_after_probe_every_then_less_often(store, clock):
    """Envoy's ejection backoff: open probe_every (2 s) after the threshold, then one
    probe_every longer after each failed probe (4, 6 ... s), capped at failure_cooldown."""
    policy = BreakerPolicy(failure_threshold=5, failure_cooldown=7.0, probe_every=2.0)
    for _ in range(5):
        ticket = await store.breaker_acquire(R, B, policy)
        change = await store.breaker_record(R, B, policy, "failure", gen=ticket.gen)
    assert change.retry_in == pytest.approx(2.0, abs=0.01)
    waits = []
    for _ in range(4):
        clock.advance(change.retry_in - 0.5)
        assert not (await store.breaker_acquire(R, B, policy)).admitted
        clock.advance(0.5)
        probe = await store.breaker_acquire(R, B, policy)
        assert (probe.admitted, probe.state) == (True, "half_open")
        assert probe.probe
        assert not (await store.breaker_acquire(R, B, policy)).admitted  # one at a time
        change = await store.breaker_record(
            R, B, policy, "failure", gen=probe.gen, probe=probe.probe
        )
        assert change.state == "open"
        waits.append(round(change.retry_in, 2))
    assert waits == [4.0, 6.0, 7.0, 7.0]  # 2 s more each time, up to the cap
    clock.advance(7.0)
    probe = await store.breaker_acquire(R, B, policy)
    change = await store.breaker_record(R, B, policy, "success", gen=probe.gen, probe=probe.probe)
    assert change.transitions == ("closed",)
    for _ in range(5):  # a success ends the streak: the next open starts again at 2 s
        ticket = await store.breaker_acquire(R, B, policy)
        change = await store.breaker_record(R, B, policy, "failure", gen=ticket.gen)
    assert change.retry_in == pytest.approx(2.0, abs=0.01)


async def test_probe_every_zero_keeps_the_whole_failure_cooldown(store, clock):
    policy = BreakerPolicy(failure_threshold=1, failure_cooldown=30.0, probe_every=0.0)
    ticket = await store.breaker_acquire(R, B, policy)
    change = await store.breaker_record(R, B, policy, "failure", gen=ticket.gen)
    assert change.retry_in == pytest.approx(30.0, abs=0.01)
    clock.advance(30.0)
    probe = await store.breaker_acquire(R, B, policy)
    change = await store.breaker_record(R, B, policy, "failure", gen=probe.gen, probe=probe.probe)
    assert change.retry_in == pytest.approx(30.0, abs=0.01)


async def test_no_recovery_probe_before_the_cooldown_for_saturation_or_retry_after(store, clock):
    policy = BreakerPolicy(probe_every=10.0, saturation_threshold=2, retry_after_cap=120.0)
    for _ in range(2):
        ticket = await store.breaker_acquire(R, B, policy)
        await store.breaker_record(R, B, policy, "saturation", gen=ticket.gen)
    ticket = await store.breaker_acquire("other", B, policy)
    await store.breaker_record("other", B, policy, "failure", gen=ticket.gen, retry_after=60.0)
    clock.advance(20)
    saturated = await store.breaker_acquire(R, B, policy)
    limited = await store.breaker_acquire("other", B, policy)
    assert (saturated.admitted, saturated.reason) == (False, "saturation")
    assert (limited.admitted, limited.reason) == (False, "retry_after")
