"""The Picker's filters and scorers, one piece at a time, and today's policy as their sum.

Each piece reads a :class:`Candidate` (what the gateway knows of one replica); the Picker
builds the composition once (``Picker.policy``) and runs it on every request's replicas.
"""

from __future__ import annotations

import pytest

from tierchain import Backend, PickWeights
from tierchain.pick_policy import (
    Candidate,
    FirstData,
    HasRoom,
    InFlight,
    KvCache,
    NotOpen,
    PickPolicy,
    SlotsBusy,
    Waiting,
    default_policy,
)
from tierchain.picker import Picker
from tierchain.probes import Status


def _c(name: str, **facts: object) -> Candidate:
    return Candidate(Backend(name=name, url="http://127.0.0.1:1"), **facts)


def test_not_open_passes_only_replicas_whose_breaker_is_not_open():
    a, b, c = _c("a"), _c("b", open=True), _c("c")
    assert NotOpen()([a, b, c]) == [a, c]


def test_has_room_rejects_a_replica_at_its_limit_or_with_a_full_status():
    a, b, c, d = _c("a"), _c("b", leases_full=True), _c("c", status_full=True), _c("d")
    assert HasRoom()([a, b, c, d]) == [a, d]


def test_in_flight_counts_attempts_in_flight():
    assert InFlight(1.0)(_c("a", in_flight=3)) == 3.0
    assert InFlight(1.0)(_c("a")) == 0.0


@pytest.mark.parametrize(
    ("scorer", "status", "expected"),
    [
        (Waiting(1.0), Status(busy=True, waiting=4), 4.0),
        (Waiting(1.0), Status(busy=True), 0.0),  # not said: adds nothing
        (KvCache(2.0), Status(busy=True, kv_cache=0.75), 0.75),
        (KvCache(2.0), Status(busy=True), 0.0),
        (SlotsBusy(1.0), Status(busy=True, slots=4, slots_busy=3), 0.75),
        (SlotsBusy(1.0), Status(busy=True, slots=0, slots_busy=0), 0.0),  # no slots: nothing
        (SlotsBusy(1.0), Status(busy=True, slots=4), 0.0),
    ],
    ids=["waiting", "waiting unknown", "kv", "kv unknown", "slots", "no slots", "busy unknown"],
)
def test_each_status_scorer_reads_its_one_fact_and_nothing_when_not_known(scorer, status, expected):
    assert scorer(_c("a", status=status)) == expected
    assert scorer(_c("a")) == 0.0  # no status at all


def test_first_data_is_the_learned_time_in_seconds():
    assert FirstData(0.1)(_c("a", first_data=2.5)) == 2.5
    assert FirstData(0.1)(_c("a")) == 0.0


def test_the_classes_put_the_first_filters_rejects_last():
    policy = default_policy(PickWeights())
    free, full, open_, open_and_full = (
        _c("free"),
        _c("full", leases_full=True),
        _c("open", open=True),
        _c("both", open=True, status_full=True),
    )
    assert policy.classes([open_, full, free, open_and_full]) == [2, 1, 0, 2]


def test_the_score_is_the_weighted_sum_of_the_scorers():
    policy = PickPolicy((), (InFlight(1.0), KvCache(2.0), FirstData(0.1)))
    c = _c("a", in_flight=2, status=Status(busy=True, kv_cache=0.5), first_data=3.0)
    assert policy.score(c) == pytest.approx(2.0 + 1.0 + 0.3)
    assert policy.rank([c]) == [(0, policy.score(c))]


def test_todays_policy_is_two_filters_and_five_scorers_with_the_pick_weights():
    w = PickWeights(in_flight=3.0, waiting=4.0, kv_cache=5.0, slots=6.0, first_data=7.0)
    policy = default_policy(w)
    assert [type(f) for f in policy.filters] == [NotOpen, HasRoom]
    assert [(type(s), s.weight) for s in policy.scorers] == [
        (InFlight, 3.0),
        (Waiting, 4.0),
        (KvCache, 5.0),
        (SlotsBusy, 6.0),
        (FirstData, 7.0),
    ]


def test_the_picker_builds_its_policy_once_not_per_request():
    picker = Picker(PickWeights(), admission=None)
    policy = picker.policy
    assert isinstance(policy, PickPolicy)
    assert picker.policy is policy
