"""Hedging's rules one by one (docs/hedging.md): which attempt gets a timer (and every
"never hedge" case: the last tier, a second try, a forced try, a continuation, a committed
request, a pool on either side, the next tier being the same backend or on the same
hardware, a backend not marked for it), and when the timer fires, which attempt is still in
doubt enough to start the next tier beside it (no data yet, nothing committed, a verdict in
doubt, budget left past the reserve and one second).

The policy's functions are called with a request's state and a stand-in for Failover's
responder (what :meth:`Hedging.arm` reads of it); the end-to-end cases, with real sockets,
are test_hedging.py and test_hedging_never.py.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest

from tierchain import Backend
from tierchain._runtime import deadlines
from tierchain.backend import Pool
from tierchain.failover.hedging import Hedging, Race, may_hedge
from tierchain.observer import Observer
from tierchain.request import Attempt, TierRequest

from .support import now, on_virtual_time

TOWER = Backend("tower", "http://127.0.0.1:9", shares="gpu0")
HOSTED = Backend("hosted", "https://api.example.com")
LAPTOP = Backend("laptop", "http://127.0.0.1:8", shares="gpu1")


class Responder:
    """What Hedging.arm and Race read of Failover's responder."""

    def __init__(self, req: TierRequest, attempt: Attempt) -> None:
        self.req = req
        self.attempt = attempt
        self.guard = None
        self.caller_send = None
        self.race: Race | None = None
        self.span = None


def asked(*chain: Any, n: int = 1, **attempt: Any) -> Responder:
    req = TierRequest()
    req.route = "echo"
    req.chain = tuple(chain)
    req.attempt = Attempt(n, len(chain), chain[n - 1], "echo", **attempt)
    return Responder(req, req.attempt)


FAILOVER: Any = object()  # (what arm hands the race: Failover, and the scope's copy)
SCOPE: Any = object()


def armed(responder: Responder, after: float = 2.0) -> Race | None:
    race = Hedging(after).arm(FAILOVER, responder, SCOPE)  # type: ignore[arg-type]
    if race is not None:
        deadlines.cancel(race.timer)
    return race


def test_hedge_after_is_a_duration_and_zero_or_none_is_no_policy():
    assert Hedging.checked(None) is None
    assert Hedging.checked(timedelta(milliseconds=1500)) == 1.5
    assert Hedging.checked(0) == 0
    assert Hedging.build(None) is None
    assert Hedging.build(0) is None
    policy = Hedging.build(3)
    assert policy is not None
    assert policy.after == 3.0
    with pytest.raises(ValueError, match=r"^hedge_after must be a finite number of seconds"):
        Hedging.checked(-1)


def test_hedge_written_on_a_backend_wins_over_where_it_is():
    assert may_hedge(TOWER) is True  # local, nothing written
    assert may_hedge(HOSTED) is False
    assert may_hedge(Backend("h", "https://api.example.com", hedge=True)) is True
    assert may_hedge(Backend("t", "http://127.0.0.1:7", hedge=False)) is False
    policy = Hedging(2.0)
    marked = Backend("t", "http://127.0.0.1:7", hedge=False)
    assert policy.may_hedge(marked) is False
    assert policy.may_hedge(marked) is False  # (the answer kept per backend)
    assert policy.may_hedge(TOWER) is True


@on_virtual_time
async def test_a_local_tier_before_another_gets_its_timer_for_the_next_tier():
    responder = asked(TOWER, HOSTED)
    race = armed(responder)
    assert race is not None
    assert race.next is HOSTED
    assert responder.race is race
    assert (race.req, race.attempt, race.first) == (responder.req, responder.attempt, responder)
    assert race.failover is FAILOVER
    assert race.scope is SCOPE


@on_virtual_time
async def test_a_hedge_onto_other_hardware_is_armed():
    assert armed(asked(TOWER, LAPTOP)) is not None


@pytest.mark.parametrize(
    ("why", "responder"),
    [
        ("the last tier", lambda: asked(TOWER)),
        ("the last tier of two", lambda: asked(HOSTED, TOWER, n=2)),
        ("a second try", lambda: asked(TOWER, HOSTED, retry=1)),
        ("a forced try", lambda: asked(TOWER, HOSTED, force=True)),
        ("not marked", lambda: asked(HOSTED, TOWER)),
        (
            "the same hardware",
            lambda: asked(TOWER, Backend("t2", "http://127.0.0.1:6", shares="gpu0")),
        ),
        ("the same backend", lambda: asked(TOWER, TOWER)),
        ("into a pool", lambda: asked(TOWER, *Pool("p", [LAPTOP]).backends)),
        ("out of a pool", lambda: asked(*Pool("p", [LAPTOP]).backends, HOSTED)),
    ],
)
@on_virtual_time
async def test_never_hedged(why: str, responder: Any):
    assert armed(responder()) is None, why


@on_virtual_time
async def test_a_committed_request_or_a_continuation_is_never_hedged():
    responder = asked(TOWER, HOSTED)
    responder.req.committed = True
    assert armed(responder) is None
    responder = asked(TOWER, HOSTED)
    responder.req.continuation = object()
    assert armed(responder) is None


@on_virtual_time
async def test_an_attempt_past_its_chain_is_never_hedged():
    responder = asked(TOWER, HOSTED)
    responder.attempt = Attempt(2, 3, TOWER, "echo")  # of 3 in a chain of 2
    assert armed(responder) is None


# -- when the timer fires -------------------------------------------------------------------


def due(race: Race, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Fire the race's timer: True when it starts the hedge."""
    started: list[Race] = []
    monkeypatch.setattr(Race, "_start", lambda self: started.append(self))
    race._due()
    assert race.timer is None
    return started == [race]


def in_doubt(**attempt: Any) -> Race:
    responder = asked(TOWER, HOSTED, **attempt)
    responder.req.observer = Observer()
    race = armed(responder)
    assert race is not None
    return race


@on_virtual_time
async def test_a_quiet_attempt_in_doubt_starts_the_hedge(monkeypatch):
    for verdict in (None, "working", "unknown"):
        race = in_doubt()
        race.attempt.verdict = verdict
        assert due(race, monkeypatch), verdict


@on_virtual_time
async def test_no_hedge_once_the_attempt_is_no_longer_in_doubt(monkeypatch):
    race = in_doubt()
    race.attempt.verdict = "too_slow"
    assert not due(race, monkeypatch)
    race = in_doubt()
    race.first_over = True
    assert not due(race, monkeypatch)
    race = in_doubt()
    race.req.committed = True
    assert not due(race, monkeypatch)
    race = in_doubt()
    race.req.aborted = True
    assert not due(race, monkeypatch)
    race = in_doubt()
    race.req.attempt = Attempt(1, 2, TOWER, "echo")  # another attempt now
    assert not due(race, monkeypatch)
    race = in_doubt()
    race.req.observer = None
    assert not due(race, monkeypatch)
    race = in_doubt()
    assert race.req.observer is not None
    race.req.observer.first_data_at = now()
    assert not due(race, monkeypatch)


@on_virtual_time
async def test_no_hedge_when_the_budget_left_is_the_reserve_or_a_second(monkeypatch, caplog):
    race = in_doubt(reserve=3.0)
    race.req.deadline = now() + 3.0
    with caplog.at_level(logging.INFO, logger="tierchain"):
        assert not due(race, monkeypatch)
    (line,) = [r for r in caplog.records if getattr(r, "event", None) == "dispatch.hedge_skipped"]
    assert line.tierchain == {
        "route": "echo",
        "backend": "tower",
        "hedge": "hosted",
        "left_s": 3.0,
        "reason": "budget",
    }
    race = in_doubt(reserve=3.0)
    race.req.deadline = now() + 3.001
    assert due(race, monkeypatch)
    race = in_doubt()
    race.req.deadline = now() + 1.0
    assert not due(race, monkeypatch)
    race = in_doubt()
    race.req.deadline = now() + 0.12345
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tierchain"):
        assert not due(race, monkeypatch)
    (line,) = [r for r in caplog.records if getattr(r, "event", None) == "dispatch.hedge_skipped"]
    assert line.tierchain["left_s"] == 0.123
    race = in_doubt()
    race.req.deadline = now() + 1.001
    assert due(race, monkeypatch)
