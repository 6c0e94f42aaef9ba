"""The Picker's policy as small named pieces: filters that class replicas, scorers that weigh them.

As llm-d's scheduler plugins do, each rule is one object behind one interface, and the policy
is their composition, built once per :class:`~tierchain.picker.Picker` (nothing here is made
per request but the facts of each replica and the lists the filters return):

- a :class:`Filter` takes candidates and returns those that pass it. A replica is never
  dropped (a pool's replicas are all tried, as a chain is never shortened): one a filter
  rejects is demoted instead, to a class tried after every replica that passed. With the
  filters in order ``f1 .. fn``, a replica ``fi`` rejects is in class ``n - i + 1``, one that
  passes them all in class 0.
- a :class:`Scorer` turns one fact of a candidate into a number (0 when not known) and has a
  ``weight`` (a field of :class:`~tierchain.picker.PickWeights`); a replica's score is the
  sum of weight times number, lowest first within a class.

Today's policy (:func:`default_policy`): :class:`NotOpen`, then :class:`HasRoom` (so the
classes are free, full, open), and the five scorers :class:`InFlight`, :class:`Waiting`,
:class:`KvCache`, :class:`SlotsBusy` and :class:`FirstData`.

A policy of one's own (``Failover(pick_policy=...)``, ``TIERCHAIN_FAILOVER_PICK_POLICY``) is
anything with ``rank`` (:class:`Ranking`), usually a :class:`PickPolicy` of these pieces and
scorers of one's own; :func:`resolve_policy` turns what the option was given into one, once.
The contract of a scorer (docs/pools.md, "Adding a scorer"): synchronous, no I/O, never
raising on a fact it does not know (0.0); its number is in its fact's own unit and lower is
better; its weight turns that unit into score points, compared in steps of
``PickWeights.resolution``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

from .backend import Backend
from .probes import Status

__all__ = [
    "Candidate",
    "Filter",
    "FirstData",
    "HasRoom",
    "InFlight",
    "KvCache",
    "NotOpen",
    "PickPolicy",
    "PolicyOption",
    "Ranking",
    "Scorer",
    "SlotsBusy",
    "Waiting",
    "Weights",
    "default_policy",
    "resolve_policy",
]


@dataclass(slots=True)
class Candidate:
    """What the gateway knows of one replica now: the facts every filter and scorer reads."""

    backend: Backend
    in_flight: int = 0
    """Attempts in flight (this process's, or the store's leases when it has a limit)."""
    leases_full: bool = False
    """Its ``max_in_flight`` is reached."""
    status: Status | None = None
    """Its polled status, when a board polls its ``status_url``."""
    status_full: bool = False
    """Its polled status is past the board's fullness thresholds."""
    first_data: float | None = None
    """Its learned time to first data (seconds), once learned."""
    open: bool = False
    """Its breaker is open (in the store, or skipped as open here within its ``retry_in``)."""


class Filter(Protocol):
    """Candidates in, those that pass out (in the same order); the rest are demoted."""

    def __call__(self, candidates: Sequence[Candidate]) -> list[Candidate]: ...


class Scorer(Protocol):
    """One fact of a candidate as a number (0.0 when not known), and its weight."""

    @property
    def weight(self) -> float: ...

    def __call__(self, candidate: Candidate) -> float: ...


class Ranking(Protocol):
    """What the Picker asks of a policy: each candidate's (class, score), in the order given.

    Class 0 goes first, then 1, and so on; within a class the lowest score goes first.
    """

    def rank(self, candidates: Sequence[Candidate]) -> list[tuple[int, float]]: ...


class Weights(Protocol):
    """The weights :func:`default_policy` reads (:class:`~tierchain.picker.PickWeights`)."""

    @property
    def in_flight(self) -> float: ...
    @property
    def waiting(self) -> float: ...
    @property
    def kv_cache(self) -> float: ...
    @property
    def slots(self) -> float: ...
    @property
    def first_data(self) -> float: ...


class NotOpen:
    """Passes a replica whose breaker is not open."""

    __slots__ = ()

    def __call__(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        return [c for c in candidates if not c.open]


class HasRoom:
    """Passes a replica with room: its ``max_in_flight`` not reached, its status not full."""

    __slots__ = ()

    def __call__(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        return [c for c in candidates if not (c.leases_full or c.status_full)]


@dataclass(frozen=True, slots=True)
class InFlight:
    """Per attempt in flight at the replica."""

    weight: float

    def __call__(self, candidate: Candidate) -> float:
        return float(candidate.in_flight)


@dataclass(frozen=True, slots=True)
class Waiting:
    """Per request its status says is waiting."""

    weight: float

    def __call__(self, candidate: Candidate) -> float:
        status = candidate.status
        if status is None or status.waiting is None:
            return 0.0
        return float(status.waiting)


@dataclass(frozen=True, slots=True)
class KvCache:
    """Its KV-cache use, 0..1 (status)."""

    weight: float

    def __call__(self, candidate: Candidate) -> float:
        status = candidate.status
        if status is None or status.kv_cache is None:
            return 0.0
        return float(status.kv_cache)


@dataclass(frozen=True, slots=True)
class SlotsBusy:
    """The share of its slots that are busy, 0..1 (status)."""

    weight: float

    def __call__(self, candidate: Candidate) -> float:
        status = candidate.status
        if status is None or not status.slots or status.slots_busy is None:
            return 0.0
        return status.slots_busy / status.slots


@dataclass(frozen=True, slots=True)
class FirstData:
    """Its learned time to first data, in seconds."""

    weight: float

    def __call__(self, candidate: Candidate) -> float:
        return 0.0 if candidate.first_data is None else candidate.first_data


class PickPolicy:
    """Filters in order and weighted scorers, composed: each candidate's (class, score)."""

    __slots__ = ("filters", "scorers")

    def __init__(self, filters: Sequence[Filter], scorers: Sequence[Scorer]) -> None:
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)

    def classes(self, candidates: Sequence[Candidate]) -> list[int]:
        """Each candidate's class: 0 when it passes every filter; when filter ``i`` (from 1)
        rejects it, ``n - i + 1`` (the first filter's rejects go last)."""
        n = len(self.filters)
        cls = [0] * len(candidates)
        left: Sequence[Candidate] = candidates
        for i, keep in enumerate(self.filters):
            kept = keep(left)
            if len(kept) != len(left):  # (the usual case, all pass, costs no set)
                passed = {id(c) for c in kept}
                rejected = {id(c) for c in left if id(c) not in passed}
                for at, c in enumerate(candidates):
                    if id(c) in rejected:
                        cls[at] = n - i
            left = kept
        return cls

    def score(self, candidate: Candidate) -> float:
        """The sum of each scorer's weight times its number."""
        total = 0.0
        for scorer in self.scorers:
            total += scorer.weight * scorer(candidate)
        return total

    def rank(self, candidates: Sequence[Candidate]) -> list[tuple[int, float]]:
        """(class, score) of each candidate, in the order given."""
        return [
            (cls, self.score(c))
            for cls, c in zip(self.classes(candidates), candidates, strict=True)
        ]


def default_policy(weights: Weights) -> PickPolicy:
    """Today's policy: breaker open last, then full; scored by the five weighted facts."""
    return PickPolicy(
        (NotOpen(), HasRoom()),
        (
            InFlight(weights.in_flight),
            Waiting(weights.waiting),
            KvCache(weights.kv_cache),
            SlotsBusy(weights.slots),
            FirstData(weights.first_data),
        ),
    )


PolicyOption: TypeAlias = "Ranking | Callable[[Weights], Ranking] | str"
"""What ``pick_policy`` takes: a policy, a function of the weights that builds one, or the
import path (``package.module:name``) of either."""


def resolve_policy(option: PolicyOption | None, weights: Weights) -> Ranking | None:
    """The policy ``option`` names, built once (None: the default policy, built by the Picker).

    Raises ValueError, in one sentence, for anything that is not a policy."""
    if option is None:
        return None
    found: object = option
    if isinstance(option, str):
        module, colon, name = option.partition(":")
        if not colon or not module or not name:
            raise ValueError(
                f"pick_policy {option!r} is not an import path such as 'mypackage.scoring:policy'"
            )
        try:
            found = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"pick_policy {option!r} cannot be imported: {exc}") from None
    if not callable(getattr(found, "rank", None)) and callable(found):
        found = found(weights)  # a builder, given the weights
    if not callable(getattr(found, "rank", None)):
        raise ValueError(
            f"pick_policy must be a policy with rank(candidates) (such as a "
            f"tierchain.pick_policy.PickPolicy), or a function of the weights that returns one; "
            f"got {found!r}"
        )
    return found  # type: ignore[return-value]
