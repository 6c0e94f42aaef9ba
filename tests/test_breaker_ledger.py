"""The breaker's ledger rules one by one, with exact values (docs/breaker.md): what opens
it and for how long, what its reason is, the half-open probe slot, the re-open backoffs,
verdicts from an older generation, and what a reader sees.

These are the rules every store runs (:mod:`tierchain.breaker_state`); the store's clock
is the ``now`` each call is given, so every time here is exact. The model test
(test_breaker_model.py) drives random interleavings against a restatement of the same
rules; this file pins each rule's edges.
"""

from __future__ import annotations

import pytest

from tierchain.breaker_state import (
    PROBE_BUSY_RETRY,
    BreakerChange,
    BreakerPolicy,
    BreakerSnapshot,
    Ledger,
    Ticket,
    acquire,
    failure_wait,
    record,
    reopen_cooldown,
    snapshot,
)

POLICY = BreakerPolicy(
    failure_threshold=3,
    failure_cooldown=30.0,
    saturation_threshold=2,
    saturation_cooldown=900.0,
    retry_after_cap=100.0,
    probe_lease=60.0,
    saturation_backoff=30.0,
    stream_failure_threshold=2,
    probe_every=2.0,
)
T = 1000.0  # the store's clock at the start of each test


def opened(reason: str = "failure", until: float = T + 30.0, gen: int = 1) -> Ledger:
    return Ledger(state="open", failures=3, open_until=until, gen=gen, reason=reason)


# -- how long -------------------------------------------------------------------------


def test_a_saturated_probes_reopen_doubles_from_the_backoff_up_to_the_cooldown():
    assert [reopen_cooldown(POLICY, n) for n in range(6)] == [30, 60, 120, 240, 480, 900]
    assert reopen_cooldown(POLICY, 10_000) == 900  # capped, never an overflow


def test_a_backoff_under_a_second_doubles_from_itself():
    policy = BreakerPolicy(saturation_backoff=0.5, saturation_cooldown=900.0)
    assert [reopen_cooldown(policy, n) for n in (0, 1, 2)] == [0.5, 1.0, 2.0]
    policy = BreakerPolicy(probe_every=0.5, failure_cooldown=30.0)
    assert [failure_wait(policy, n) for n in (0, 1, 2)] == [0.5, 1.0, 1.5]


def test_a_saturated_probe_under_a_short_backoff_reopens_for_that_backoff_alone():
    policy = BreakerPolicy(saturation_backoff=0.25, saturation_threshold=2)
    led = Ledger(state="half_open", saturations=2, gen=1, reason="saturation")
    change = record(led, T, policy, "saturation", gen=1)
    assert change == BreakerChange("open", 0.25, 0, 3, ("open",), "saturation")


def test_without_a_saturation_backoff_every_reopen_is_the_whole_cooldown():
    policy = BreakerPolicy(saturation_backoff=0.0, saturation_cooldown=900.0)
    assert [reopen_cooldown(policy, n) for n in (0, 1, 7)] == [900, 900, 900]


def test_a_failures_cooldown_grows_by_probe_every_up_to_the_failure_cooldown():
    assert [failure_wait(POLICY, n) for n in (0, 1, 2, 14, 15, 100)] == [2, 4, 6, 30, 30, 30]
    policy = BreakerPolicy(probe_every=0.0, failure_cooldown=30.0)
    assert [failure_wait(policy, n) for n in (0, 3)] == [30, 30]


# -- what opens it ----------------------------------------------------------------------


def test_failures_below_the_threshold_count_and_the_threshold_opens_for_probe_every():
    led = Ledger()
    for n in (1, 2):
        change = record(led, T, POLICY, "failure", gen=0)
        assert change == BreakerChange("closed", None, n, 0, (), "")
    change = record(led, T + 1, POLICY, "failure", gen=0)
    assert change == BreakerChange("open", 2.0, 3, 0, ("open",), "failure")
    assert (led.gen, led.open_until, led.probe_until) == (1, T + 3, 0.0)


def test_saturations_open_at_their_own_threshold_for_the_saturation_cooldown():
    led = Ledger()
    assert record(led, T, POLICY, "saturation", gen=0) == BreakerChange("closed", None, 0, 1)
    change = record(led, T, POLICY, "saturation", gen=0)
    assert change == BreakerChange("open", 900.0, 0, 2, ("open",), "saturation")


def test_mid_stream_deaths_open_at_their_threshold_with_their_own_reason():
    led = Ledger()
    assert record(led, T, POLICY, "stream_failure", gen=0).state == "closed"
    change = record(led, T, POLICY, "stream_failure", gen=0)
    assert change == BreakerChange("open", 2.0, 2, 0, ("open",), "stream_failure")
    assert led.stream_failures == 2


def test_a_mid_stream_death_that_reaches_the_failure_threshold_is_named_a_failure():
    led = Ledger(failures=2)
    change = record(led, T, POLICY, "stream_failure", gen=0)
    assert change == BreakerChange("open", 2.0, 3, 0, ("open",), "failure")


def test_a_retry_after_opens_at_once_for_its_seconds_capped():
    led = Ledger()
    change = record(led, T, POLICY, "failure", gen=0, retry_after=7.0)
    assert change == BreakerChange("open", 7.0, 1, 0, ("open",), "retry_after")
    led = Ledger()
    change = record(led, T, POLICY, "saturation", gen=0, retry_after=5000.0)
    assert change == BreakerChange("open", 100.0, 0, 1, ("open",), "retry_after")


def test_a_retry_after_under_a_second_opens_for_just_that_long():
    led = Ledger()
    change = record(led, T, POLICY, "failure", gen=0, retry_after=0.5)
    assert change == BreakerChange("open", 0.5, 1, 0, ("open",), "retry_after")


def test_a_retry_after_longer_than_the_tripped_cooldown_names_itself_not_when_shorter():
    led = Ledger(failures=2)
    change = record(led, T, POLICY, "failure", gen=0, retry_after=2.5)
    assert (change.retry_in, change.reason) == (2.5, "retry_after")
    led = Ledger(failures=2)
    change = record(led, T, POLICY, "failure", gen=0, retry_after=2.0)  # as long: the failure
    assert (change.retry_in, change.reason) == (2.0, "failure")
    led = Ledger(failures=2)
    change = record(led, T, POLICY, "failure", gen=0, retry_after=1.0)
    assert (change.retry_in, change.reason) == (2.0, "failure")


def test_a_neutral_outcome_counts_for_nothing_and_gives_the_probe_slot_back():
    led = Ledger(state="half_open", failures=3, gen=1, probe_token=4, probe_until=T + 60)
    change = record(led, T, POLICY, "neutral", gen=1, probe=4)
    assert change == BreakerChange("half_open", None, 3, 0)
    assert led.probe_until == 0.0
    assert acquire(led, T, POLICY).probe == 5


def test_a_verdict_with_another_probes_token_keeps_the_slot_taken():
    led = Ledger(state="half_open", gen=1, probe_token=4, probe_until=T + 60)
    record(led, T, POLICY, "neutral", gen=1, probe=3)
    assert led.probe_until == T + 60
    record(led, T, POLICY, "neutral", gen=1)  # (no probe: 0)
    assert led.probe_until == T + 60
    first = Ledger(state="half_open", gen=1, probe_token=1, probe_until=T + 60)
    record(first, T, POLICY, "neutral", gen=1)  # not the first probe's verdict either
    assert first.probe_until == T + 60


# -- what closes it -------------------------------------------------------------------------


def test_a_fresh_success_closes_and_clears_everything():
    led = Ledger(
        state="half_open",
        failures=3,
        saturations=1,
        stream_failures=1,
        open_until=T - 1,
        probe_until=T + 60,
        probe_token=2,
        gen=4,
        reason="saturation",
        reopens=3,
    )
    change = record(led, T, POLICY, "success", gen=4, probe=2)
    assert change == BreakerChange("closed", None, 0, 0, ("closed",), "")
    assert led == Ledger(probe_token=2, gen=4)


def test_a_success_while_closed_clears_the_counts_without_a_transition():
    led = Ledger(failures=2, saturations=1, stream_failures=1)
    assert record(led, T, POLICY, "success", gen=0) == BreakerChange("closed", None, 0, 0)
    assert led.stream_failures == 0


def test_a_success_from_before_the_breaker_opened_changes_nothing():
    led = opened(gen=2)
    change = record(led, T, POLICY, "success", gen=1)
    assert change == BreakerChange("open", 30.0, 3, 0, (), "failure")
    assert led.state == "open"


# -- the probe ----------------------------------------------------------------------------


def test_an_open_breaker_turns_attempts_away_with_the_seconds_left_and_its_reason():
    led = opened("retry_after", until=T + 30)
    assert acquire(led, T + 12, POLICY) == Ticket(
        False, "open", 1, 0, 18.0, (), reason="retry_after"
    )


def test_a_closed_breaker_admits_and_says_clean_only_with_both_counts_at_zero():
    assert acquire(Ledger(gen=3), T, POLICY) == Ticket(True, "closed", 3, 0, None, (), True)
    assert acquire(Ledger(failures=1), T, POLICY).clean is False
    assert acquire(Ledger(saturations=1), T, POLICY).clean is False


def test_a_forced_attempt_goes_through_an_open_breaker_and_is_never_clean():
    led = opened()
    assert acquire(led, T, POLICY, force=True) == Ticket(True, "open", 1, 0, None, (), False)
    assert led.probe_token == 0


def test_the_cooldowns_end_half_opens_it_and_the_first_caller_is_the_probe():
    led = opened(until=T + 30)
    ticket = acquire(led, T + 30, POLICY)  # at the very end of the cooldown
    assert ticket == Ticket(True, "half_open", 1, 1, None, ("half_open",))
    assert led.probe_until == T + 30 + 60
    busy = acquire(led, T + 31, POLICY)
    assert busy == Ticket(False, "half_open", 1, 0, PROBE_BUSY_RETRY, (), reason="failure")
    # A probe that never reports holds the slot for probe_lease, then the next goes.
    assert acquire(led, T + 89.5, POLICY).admitted is False
    assert acquire(led, T + 90, POLICY) == Ticket(True, "half_open", 1, 2, None, ())


def test_an_idle_backend_wakes_a_breaker_open_for_saturation_only():
    led = opened("saturation", until=T + 900)
    ticket = acquire(led, T + 5, POLICY, wake=True)
    assert ticket == Ticket(True, "half_open", 1, 1, None, ("half_open",))
    failing = opened("failure", until=T + 30)
    assert acquire(failing, T + 5, POLICY, wake=True).state == "open"
    assert failing.open_until == T + 30
    assert acquire(opened("saturation", until=T + 900), T + 5, POLICY).state == "open"


# -- a failed probe -------------------------------------------------------------------------


def test_a_failed_probe_reopens_one_probe_every_longer_each_time():
    led = Ledger(state="half_open", failures=3, gen=1, reason="failure", probe_token=1)
    change = record(led, T, POLICY, "failure", gen=1, probe=1)
    assert change == BreakerChange("open", 4.0, 4, 0, ("open",), "failure")
    assert (led.gen, led.reopens) == (2, 1)
    assert acquire(led, T + 4, POLICY).probe == 2
    change = record(led, T + 4, POLICY, "failure", gen=2, probe=2)
    assert change == BreakerChange("open", 6.0, 5, 0, ("open",), "failure")
    assert led.reopens == 2


def test_a_saturated_probe_reopens_for_the_doubling_backoff_not_the_whole_cooldown():
    led = Ledger(state="half_open", saturations=2, gen=1, reason="saturation", reopens=2)
    change = record(led, T, POLICY, "saturation", gen=1)
    assert change == BreakerChange("open", 120.0, 0, 3, ("open",), "saturation")
    assert led.reopens == 3


def test_a_failed_probe_with_a_longer_retry_after_waits_the_retry_after():
    led = Ledger(state="half_open", failures=3, gen=1, reason="failure")
    change = record(led, T, POLICY, "failure", gen=1, retry_after=50.0)
    assert change == BreakerChange("open", 50.0, 4, 0, ("open",), "retry_after")
    led = Ledger(state="half_open", gen=1, reason="saturation")
    change = record(led, T, POLICY, "saturation", gen=1, retry_after=50.0)
    assert change == BreakerChange("open", 50.0, 0, 1, ("open",), "retry_after")


def test_a_failure_from_before_the_breaker_opened_is_counted_and_nothing_more():
    led = Ledger(state="half_open", failures=3, gen=2, reason="failure", open_until=T - 1)
    change = record(led, T, POLICY, "failure", gen=1)
    assert change == BreakerChange("half_open", None, 4, 0, (), "failure")
    assert (led.gen, led.reopens, led.open_until) == (2, 0, T - 1)


def test_a_forced_attempt_failing_while_open_extends_the_cooldown_never_shortens_it():
    led = opened(until=T + 30)
    change = record(led, T, POLICY, "failure", gen=1)  # failure_wait(1): 4 s, less than 30
    assert change == BreakerChange("open", 30.0, 4, 0, (), "failure")
    change = record(led, T, POLICY, "saturation", gen=1, retry_after=80.0)
    assert change == BreakerChange("open", 80.0, 4, 1, (), "retry_after")
    assert led.gen == 1  # already open: no new generation


def test_a_failure_while_open_that_ends_no_later_keeps_the_reason_it_opened_for():
    led = opened("retry_after", until=T + 4)
    change = record(led, T, POLICY, "failure", gen=1)  # failure_wait(1): 4 s, the same end
    assert change == BreakerChange("open", 4.0, 4, 0, (), "retry_after")


def test_recording_after_the_cooldown_settles_to_half_open_first():
    led = opened(until=T + 30)
    change = record(led, T + 30, POLICY, "neutral", gen=1)
    assert change == BreakerChange("half_open", None, 3, 0, ("half_open",), "failure")


# -- what a reader sees -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("led", "at", "seen"),
    [
        (None, T, BreakerSnapshot("closed", None, 0, 0)),
        (Ledger(failures=2, saturations=1), T, BreakerSnapshot("closed", None, 2, 1)),
        (opened("saturation"), T + 10, BreakerSnapshot("open", 20.0, 3, 0, "saturation")),
        (opened(), T + 30, BreakerSnapshot("half_open", None, 3, 0)),
        (Ledger(state="half_open", failures=3), T, BreakerSnapshot("half_open", None, 3, 0)),
    ],
    ids=["none", "closed", "open", "cooled-down", "half-open"],
)
def test_a_reader_sees_the_state_without_changing_it(led, at, seen):
    assert snapshot(led, at) == seen
    if led is not None:
        assert snapshot(led, at) == seen  # nothing moved
        assert led.state in ("closed", "open", "half_open")
