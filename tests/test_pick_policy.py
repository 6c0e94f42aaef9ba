"""The Picker's filters and scorers, one piece at a time, and today's policy as their sum.

Each piece reads a :class:`Candidate` (what the gateway knows of one replica); the Picker
builds the composition once (``Picker.policy``) and runs it on every request's replicas.
"""

from __future__ import annotations

import re

import pytest

from tierchain import Backend, Failover, Forwarder, PickWeights
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
    resolve_policy,
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


# -- a policy of one's own (docs/pools.md, "Adding a scorer") --------------------------


class OlderCard:
    """A scorer of the user's: one point for the replicas named (the docs' example)."""

    weight = 1.5

    def __init__(self, *names: str) -> None:
        self.names = set(names)

    def __call__(self, candidate: Candidate) -> float:
        return 1.0 if candidate.backend.name in self.names else 0.0


def older_card_policy(weights: PickWeights) -> PickPolicy:
    base = default_policy(weights)
    return PickPolicy(base.filters, (*base.scorers, OlderCard("gpu-b")))


class Broken:
    """A policy whose rank raises."""

    def rank(self, candidates):
        raise RuntimeError("the scoring service is down")


class Short:
    """A policy that ranks one replica fewer than it was given."""

    def rank(self, candidates):
        return [(0, 0.0)] * (len(candidates) - 1)


def _replicas() -> list[Backend]:
    return [Backend(name=n, url="http://127.0.0.1:1") for n in ("gpu-b", "gpu-a")]


async def test_a_scorer_of_ones_own_orders_equal_idle_replicas():
    # Without it, two idle replicas are ordered at random (each first about half the time);
    # with it, the one on the older card is always second.
    plain = Picker(PickWeights(), admission=None)
    mine = Picker(PickWeights(), admission=None, policy=older_card_policy(PickWeights()))
    plain_firsts = {(await plain.order("r", _replicas(), None))[0].name for _ in range(40)}
    mine_firsts = {(await mine.order("r", _replicas(), None))[0].name for _ in range(40)}
    assert plain_firsts == {"gpu-a", "gpu-b"}
    assert mine_firsts == {"gpu-a"}


async def test_a_scorer_of_ones_own_is_outweighed_by_a_busier_replica():
    # 1.5 points for the older card; two attempts in flight at the other weigh 2.
    mine = Picker(PickWeights(), admission=None, policy=older_card_policy(PickWeights()))
    mine._in_flight["gpu-a"] = 2
    assert [b.name for b in await mine.order("r", _replicas(), None)] == ["gpu-b", "gpu-a"]
    mine._in_flight["gpu-a"] = 1
    assert [b.name for b in await mine.order("r", _replicas(), None)] == ["gpu-a", "gpu-b"]


@pytest.mark.parametrize("policy", [Broken(), Short()], ids=["raises", "ranks too few"])
async def test_a_policy_that_fails_is_replaced_by_the_default_for_that_pick(policy, caplog):
    picker = Picker(PickWeights(), admission=None, policy=policy)
    picker._in_flight["gpu-b"] = 3  # the default policy puts the idle replica first
    with caplog.at_level("WARNING", logger="tierchain"):
        order = await picker.order("r", _replicas(), None)
    assert [b.name for b in order] == ["gpu-a", "gpu-b"]
    [record] = [r for r in caplog.records if getattr(r, "event", "") == "pool.policy_failed"]
    assert record.tierchain["using"] == "the default policy"


def test_the_policy_option_takes_a_policy_a_builder_or_an_import_path():
    weights = PickWeights()
    given = older_card_policy(weights)
    assert resolve_policy(None, weights) is None
    assert resolve_policy(given, weights) is given
    built = resolve_policy(older_card_policy, weights)
    assert isinstance(built, PickPolicy)
    assert isinstance(built.scorers[-1], OlderCard)
    imported = resolve_policy("tests.test_pick_policy:older_card_policy", weights)
    assert isinstance(imported, PickPolicy)
    assert isinstance(imported.scorers[-1], OlderCard)


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ("no_colon_here", "is not an import path"),
        ("tests.no_such_module:policy", "cannot be imported"),
        ("tests.test_pick_policy:no_such_name", "cannot be imported"),
        (42, "must be a policy with rank(candidates)"),
        (lambda weights: "not a policy", "must be a policy with rank(candidates)"),
    ],
    ids=["no colon", "no module", "no name", "a number", "a builder of nonsense"],
)
def test_a_policy_option_that_is_no_policy_is_refused_in_one_sentence(option, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        resolve_policy(option, PickWeights())


def test_failover_passes_its_policy_to_the_picker_and_refuses_a_bad_one():
    routes = {"echo": [Backend(name="a", url="http://127.0.0.1:1")]}
    failover = Failover(Forwarder(), routes=routes, pick_policy=older_card_policy)
    assert isinstance(failover.picker.policy, PickPolicy)
    assert isinstance(failover.picker.policy.scorers[-1], OlderCard)
    with pytest.raises(ValueError, match="pick_policy"):
        Failover(Forwarder(), routes=routes, pick_policy="nowhere:policy")


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("not an import path", "expected an import path"),
        ("tests.test_pick_policy:no_such_name", "cannot be imported"),
    ],
    ids=["not a path", "not there"],
)
def test_the_environment_names_the_policy_by_import_path(value, says, tmp_path):
    from tierchain.config import from_env
    from tierchain.errors import ConfigError

    routes = tmp_path / "routes.toml"
    routes.write_text('[[routes.echo.backends]]\nname = "a"\nurl = "http://127.0.0.1:1"\n')
    env = {"TIERCHAIN_ROUTES_FILE": str(routes)}
    path = "tests.test_pick_policy:older_card_policy"
    settings = from_env({**env, "TIERCHAIN_FAILOVER_PICK_POLICY": path})
    assert settings.layers["Failover"].options["pick_policy"] == path
    with pytest.raises(ConfigError, match=f"TIERCHAIN_FAILOVER_PICK_POLICY.*{says}"):
        from_env({**env, "TIERCHAIN_FAILOVER_PICK_POLICY": value})
