"""Failover's plan, rule by rule, with exact values (docs/failover.md, docs/pools.md): the next
tier and the one forced try of the soonest, when a second try of the same backend may go
and how long it pauses (its jitter, a Retry-After's spread, the budget's room), what each
failed attempt is recorded as, the state line it announces and the fault it hands on.

The plan's functions take the request's state and an attempt; the clock is the virtual
one, and ``random.random`` is pinned where a pause is drawn.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tierchain import Backend
from tierchain.errors import BackendBusy, BackendSaturated, BackendSkipped, RetryableStatus
from tierchain.failover import answers
from tierchain.failover.plan import (
    Fault,
    FaultKind,
    Tries,
    failed,
    may_retry,
    next_attempt,
    record,
    retry_pause,
)
from tierchain.request import Attempt, TierRequest

from .support import now, on_virtual_time

TOWER = Backend("tower", "http://127.0.0.1:9", shares="gpu0")
HOSTED = Backend("hosted", "http://127.0.0.1:8")
SPARE = Backend("spare", "http://127.0.0.1:7", retries=0)


def request(*chain: Backend) -> tuple[TierRequest, list[dict[str, Any]]]:
    req = TierRequest()
    req.route = "echo"
    req.chain = chain or (TOWER, HOSTED, SPARE)
    lines: list[dict[str, Any]] = []
    req.listen(lambda event: lines.append(dict(event)))
    return req, lines


def first(req: TierRequest, n: int = 1) -> Attempt:
    return Attempt(n, len(req.chain), req.chain[n - 1], req.route)


# -- what comes next ----------------------------------------------------------------------


def test_the_next_attempt_is_the_next_tier_then_none():
    req, _ = request()
    second = next_attempt(req, first(req))
    assert second == Attempt(2, 3, HOSTED, "echo", started=second.started)
    third = next_attempt(req, second)
    assert (third.n, third.backend, third.force) == (3, SPARE, False)
    assert next_attempt(req, third) is None


def test_when_every_tier_was_skipped_the_soonest_is_tried_once_forced():
    req, _ = request()
    for attempt, retry_in in ((first(req, 1), 20.0), (first(req, 2), 0.5), (first(req, 3), None)):
        record(req, attempt, "skipped", retry_in)
    assert next_attempt(req, first(req, 3)) is None  # no Breaker asked for it
    req.try_soonest = True
    forced = next_attempt(req, first(req, 3))
    assert forced is not None
    assert (forced.n, forced.of, forced.backend, forced.force) == (3, 3, SPARE, True)  # None: 0 s
    assert forced.route == "echo"
    assert next_attempt(req, forced) is None


def test_the_forced_try_goes_to_the_backend_back_soonest():
    req, _ = request()
    for attempt, retry_in in ((first(req, 1), 20.0), (first(req, 2), 5.0), (first(req, 3), 9.0)):
        record(req, attempt, "skipped", retry_in)
    req.try_soonest = True
    forced = next_attempt(req, first(req, 3))
    assert forced is not None
    assert forced.backend == HOSTED


def test_no_forced_try_while_a_tier_was_not_skipped():
    req, _ = request()
    record(req, first(req, 1), "skipped", 20.0)
    record(req, first(req, 2), "http_500")
    record(req, first(req, 3), "skipped", 1.0)
    req.try_soonest = True
    assert next_attempt(req, first(req, 3)) is None


# -- a second try of the same backend ------------------------------------------------------

TRANSIENT = Fault(FaultKind.TRANSIENT, "http_500")
WAIT = Fault(FaultKind.WAIT, "http_429")


@on_virtual_time
async def test_a_transient_fault_is_tried_again_after_up_to_a_quarter_second(monkeypatch):
    monkeypatch.setattr("random.random", lambda: 1.0)
    req, _ = request()
    tries = Tries()
    assert retry_pause(req, first(req), TRANSIENT, tries, 1, 10.0) == 0.25
    monkeypatch.setattr("random.random", lambda: 0.5)
    assert retry_pause(req, first(req), TRANSIENT, tries, 1, 10.0) == 0.125
    tries.retried = 1
    assert retry_pause(req, first(req), TRANSIENT, tries, 1, 10.0) is None  # none left
    assert retry_pause(req, first(req), TRANSIENT, tries, 2, 10.0) == 0.125


@on_virtual_time
async def test_a_backends_own_retries_win_over_the_layers(monkeypatch):
    monkeypatch.setattr("random.random", lambda: 1.0)
    req, _ = request(SPARE, Backend("many", "http://127.0.0.1:6", retries=2))
    assert retry_pause(req, first(req, 1), TRANSIENT, Tries(), 5, 10.0) is None  # retries=0
    tries = Tries()
    tries.retried = 1
    assert retry_pause(req, first(req, 2), TRANSIENT, tries, 0, 10.0) == 0.25


@on_virtual_time
async def test_a_retry_after_is_waited_out_once_with_a_tenth_more_at_random(monkeypatch):
    monkeypatch.setattr("random.random", lambda: 1.0)
    req, _ = request()
    record(req, first(req), "http_429", 4.0)
    tries = Tries()
    assert retry_pause(req, first(req), WAIT, tries, 1, 10.0) == pytest.approx(4.4)
    record(req, first(req), "http_429", 1.0)
    assert retry_pause(req, first(req), WAIT, tries, 1, 10.0) == 1.25  # at least the jitter
    record(req, first(req), "http_429", 10.0)
    assert retry_pause(req, first(req), WAIT, tries, 1, 10.0) == pytest.approx(11.0)  # at most
    record(req, first(req), "http_429", 10.5)
    assert retry_pause(req, first(req), WAIT, tries, 1, 10.0) is None  # too far off
    record(req, first(req), "http_429", None)
    assert retry_pause(req, first(req), WAIT, tries, 1, 10.0) is None  # it said nothing
    record(req, first(req), "http_429", 4.0)
    tries.waited = True
    assert retry_pause(req, first(req), WAIT, tries, 1, 10.0) is None  # once a request


@on_virtual_time
async def test_a_second_try_keeps_within_the_budgets_room_and_the_attempts_reserve(
    monkeypatch,
):
    monkeypatch.setattr("random.random", lambda: 1.0)
    req, _ = request()
    req.deadline = now() + 10.0
    attempt = Attempt(1, 3, TOWER, "echo", reserve=4.0)
    record(req, attempt, "http_429", 5.0)
    # room 6 s: the wait 5 s, its spread at most half of what is left (0.5 s)
    assert retry_pause(req, attempt, WAIT, Tries(), 1, 10.0) == pytest.approx(5.5)
    record(req, attempt, "http_429", 6.0)
    assert retry_pause(req, attempt, WAIT, Tries(), 1, 10.0) is None  # no room after it
    assert retry_pause(req, attempt, TRANSIENT, Tries(), 1, 10.0) == 0.25
    req.deadline = now() + 4.25
    assert retry_pause(req, attempt, TRANSIENT, Tries(), 1, 10.0) == pytest.approx(0.125)
    req.deadline = now() + 9.5  # room 5.5 s: the wait 5 s, then at most 0.25 s more
    record(req, attempt, "http_429", 5.0)
    assert retry_pause(req, attempt, WAIT, Tries(), 1, 10.0) == pytest.approx(5.25)


def test_a_wait_with_no_attempt_recorded_has_nothing_to_wait_for():
    req, _ = request()
    assert retry_pause(req, first(req), WAIT, Tries(), 1, 10.0) is None


@on_virtual_time
async def test_no_second_try_once_committed_cancelled_or_into_the_reserve():
    req, _ = request()
    attempt = Attempt(1, 3, TOWER, "echo", reserve=4.0)
    assert may_retry(req, attempt) is True  # no budget
    req.deadline = now() + 4.5
    assert may_retry(req, attempt) is True
    req.deadline = now() + 4.0
    assert may_retry(req, attempt) is False  # only the reserve is left
    req.deadline = None
    req.committed = True
    assert may_retry(req, attempt) is False
    req.committed = False
    req.cancel_reason = "caller_gone"
    assert may_retry(req, attempt) is False


# -- what a failed attempt is recorded and announced as --------------------------------------


@on_virtual_time
async def test_a_failed_attempt_is_recorded_with_its_time_and_what_the_backend_said():
    req, _ = request()
    attempt = first(req)
    await _sleep(1.5)
    fault = failed(
        req, attempt, RetryableStatus(429, retry_after=3.0, detail="slow down"), "http_429"
    )
    assert fault == Fault(FaultKind.WAIT, "http_429")
    (rec,) = req.attempts
    assert (rec.n, rec.backend, rec.outcome, rec.retry_after, rec.detail) == (
        1,
        "tower",
        "http_429",
        3.0,
        "slow down",
    )
    assert rec.elapsed == pytest.approx(1.5)
    assert req.rate_limited is attempt


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


def test_a_transient_status_without_retry_after_is_a_transient_fault_and_a_failed_line():
    for outcome in ("http_500", "http_502", "http_503", "http_529"):
        req, lines = request()
        status = int(outcome[5:])
        fault = failed(req, first(req), RetryableStatus(status), outcome)
        assert fault == Fault(FaultKind.TRANSIENT, outcome), outcome
        assert fault.again is True
        assert lines == [
            {"state": "backend_failed", "backend": "tower", "reason": outcome, "failing_over": True}
        ]
    req, _ = request()
    assert failed(req, first(req), RetryableStatus(503, retry_after=2.0), "http_503") == Fault(
        FaultKind.WAIT, "http_503"
    )
    req, _ = request()
    assert failed(req, first(req), RetryableStatus(500, retry_after=2.0), "http_500") == Fault(
        FaultKind.TRANSIENT, "http_500"
    )
    req, _ = request()
    assert failed(req, first(req), RetryableStatus(429), "http_429") is None
    req, _ = request()
    assert failed(req, first(req), OSError("reset"), "not_sent") == Fault(
        FaultKind.TRANSIENT, "not_sent"
    )
    req, lines = request()
    assert failed(req, first(req, 3), OSError("reset"), "connection_reset") is None
    assert lines[-1]["failing_over"] is False  # the last tier


def test_a_failed_attempt_is_counted_and_logged_with_its_place_in_the_chain(caplog):
    req, _ = request()
    with caplog.at_level(logging.INFO, logger="tierchain"):
        fault = failed(req, first(req, 2), OSError("refused"), "connect_refused")
    assert fault is None
    assert req.attempts[0].retry_after is None
    assert req.attempts[0].detail is None
    (line,) = [r for r in caplog.records if getattr(r, "event", None) == "dispatch.attempt_failed"]
    assert line.tierchain == {
        "route": "echo",
        "backend": "hosted",
        "n": 2,
        "of": 3,
        "outcome": "connect_refused",
        "failing_over": True,
    }


@pytest.mark.parametrize(
    ("busy", "why"),
    [
        (BackendBusy(in_flight=2), "max_in_flight"),
        (BackendBusy(why="3 waiting"), "status"),
        (BackendBusy(why="suspect: too_slow"), "suspect"),
    ],
    ids=["max_in_flight", "status", "suspect"],
)
def test_a_busy_backend_is_counted_by_why(busy, why, metric):
    labels = {"route": "echo", "backend": "tower", "why": why}
    before = metric("tierchain_backend_busy_total", **labels)
    req, _ = request()
    failed(req, first(req), busy, "busy")
    assert metric("tierchain_backend_busy_total", **labels) == before + 1
    unrouted = {"route": "", "backend": "tower", "why": why}
    before = metric("tierchain_backend_busy_total", **unrouted)
    req, _ = request()
    failed(req, Attempt(1, 3, TOWER, None), busy, "busy")
    assert metric("tierchain_backend_busy_total", **unrouted) == before + 1


def test_every_attempt_is_counted_by_route_backend_and_outcome(metric):
    for route, label in (("echo", "echo"), (None, "")):
        labels = {"route": label, "backend": "tower", "outcome": "http_500"}
        before = metric("tierchain_attempts_total", **labels)
        req, _ = request()
        record(req, Attempt(1, 3, TOWER, route), "http_500")
        assert metric("tierchain_attempts_total", **labels) == before + 1


def test_a_404_is_logged_as_the_base_url_mistake_it_most_likely_is(caplog):
    v1 = Backend("hosted", "https://api.example.com/v1")
    req, _ = request(v1, TOWER)
    with caplog.at_level(logging.WARNING, logger="tierchain"):
        assert failed(req, first(req), RetryableStatus(404), "http_404") is None
        failed(req, first(req, 2), RetryableStatus(500), "http_500")
    (line,) = [
        r for r in caplog.records if getattr(r, "event", None) == "dispatch.backend_not_found"
    ]
    assert line.tierchain["backend"] == "hosted"
    assert line.tierchain["failing_over"] is True
    assert "'https://api.example.com'" in line.tierchain["hint"]


def test_a_busy_backend_is_announced_and_its_shared_hardware_passed_over():
    req, lines = request()
    fault = failed(req, first(req), BackendBusy(in_flight=3), "busy")
    assert fault == Fault(FaultKind.HOLDS, "gpu0")
    assert fault.again is False
    assert lines == [
        {"state": "backend_busy", "backend": "tower", "in_flight": 3, "failing_over": True}
    ]
    req, lines = request()
    fault = failed(req, first(req), BackendBusy(why="3 waiting"), "busy")
    assert fault == Fault(FaultKind.HOLDS, "gpu0")
    assert lines[-1] == {
        "state": "backend_busy",
        "backend": "tower",
        "reason": "3 waiting",
        "failing_over": True,
    }
    req, _ = request()
    assert failed(req, first(req), BackendBusy(why="reserve"), "busy") is None  # time, not room
    req, _ = request()
    assert failed(req, first(req, 2), BackendBusy(in_flight=1), "busy") is None  # shares nothing


def test_a_saturated_backend_names_only_the_reasons_its_callers_may_not_know():
    for why, shown in (("reserve", True), ("too_slow", True), ("incomplete", True)):
        req, lines = request()
        fault = failed(req, first(req), BackendSaturated(why=why), "saturated")
        assert fault == Fault(FaultKind.HOLDS, "gpu0")
        assert lines == [
            {"state": "backend_saturated", "backend": "tower", "reason": why, "failing_over": True}
        ], shown
    req, lines = request()
    failed(req, first(req), BackendSaturated(why="first_token"), "saturated")
    assert lines[-1]["reason"] == "first_token"
    req, lines = request()
    failed(req, first(req), BackendSaturated(why="no_first_chunk"), "saturated")
    assert lines == [{"state": "backend_saturated", "backend": "tower", "failing_over": True}]


def test_a_skipped_backend_says_when_it_is_back_and_a_retry_after_skip_is_rate_limited():
    req, lines = request()
    fault = failed(req, first(req), BackendSkipped(retry_in=12.34, why="retry_after"), "skipped")
    assert fault is None
    assert lines == [
        {"state": "backend_skipped", "backend": "tower", "retry_in_s": 12.3, "failing_over": True}
    ]
    (rec,) = req.attempts
    assert (rec.retry_after, rec.detail) == (12.34, answers.SAID_WHEN_SKIP)
    assert req.rate_limited is not None
    req, lines = request()
    failed(req, first(req), BackendSkipped(why="failure"), "skipped")
    assert lines[-1]["retry_in_s"] is None
    assert req.attempts[0].detail is None
    assert req.rate_limited is None


def test_rate_limited_holds_only_while_every_attempt_so_far_said_rate_limited():
    req, _ = request()
    one, two, three = first(req, 1), first(req, 2), first(req, 3)
    record(req, one, "http_429", 1.0)
    assert req.rate_limited is one
    record(req, two, "skipped", 5.0, answers.SAID_WHEN_SKIP)
    assert req.rate_limited is two
    record(req, three, "http_500")
    assert req.rate_limited is None
    record(req, three, "http_429", 1.0)
    assert req.rate_limited is None  # an earlier attempt did not say it
    req, _ = request()
    record(req, one, "skipped", 5.0)  # a breaker's own skip: not the backend's word
    assert req.rate_limited is None


@on_virtual_time
async def test_a_pools_replica_is_recorded_and_announced_with_its_pool():
    from tierchain.backend import Pool

    pool = Pool("towers", [Backend("tower-a", "http://127.0.0.1:5")])
    replica = pool.backends[0]
    req, lines = request(replica)
    attempt = Attempt(1, 1, replica, "echo")
    await _sleep(2.5)
    failed(req, attempt, RetryableStatus(502, detail="bad"), "http_502")
    (rec,) = req.attempts
    assert (rec.n, rec.backend, rec.outcome, rec.retry_after, rec.detail, rec.pool) == (
        1,
        "tower-a",
        "http_502",
        None,
        "bad",
        "towers",
    )
    assert rec.elapsed == pytest.approx(2.5)
    req, _ = request(replica)
    failed(req, Attempt(1, 1, replica, "echo"), RetryableStatus(429, retry_after=2.0), "http_429")
    assert req.attempts[0].retry_after == 2.0
    assert lines == [
        {
            "state": "backend_failed",
            "backend": "tower-a",
            "pool": "towers",
            "reason": "http_502",
            "failing_over": False,
        }
    ]
