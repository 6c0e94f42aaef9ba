"""Failover's plan: what to try after an attempt that did not answer.

Each failed attempt is recorded and announced once (:func:`failed`), which returns a
:class:`Fault` (or None) for the next step: the same backend again after a transient
fault or a ``Retry-After`` (``retries``: :func:`retry_pause`,
:func:`again`), the next tier (:func:`next_attempt`), past a taken ``shares`` group
(a pool's next replica: :mod:`tierchain.failover.pools`). The waiting room's wait
before the first attempt is :func:`wait_for_room`. See docs/failover.md.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .._responses import (
    header,
)
from .._runtime import clock
from .._types import Scope
from ..backend import Backend
from ..errors import (
    BackendBusy,
    BackendSaturated,
    BackendSkipped,
    RetryableStatus,
)
from ..keys import caller_name, may_jump
from ..picker import Picker
from ..request import (
    Attempt,
    AttemptRecord,
    ReplicaRecord,
    TierRequest,
)
from ..telemetry import (
    BACKEND_BUSY,
    SAME_TIER_RETRIES,
    attempt_metrics,
    labelled,
    log_event,
)
from ..waiting import WaitingRoom, WaitRefused
from . import answers

__all__ = [
    "Fault",
    "FaultKind",
    "Tries",
    "again",
    "failed",
    "may_retry",
    "named",
    "next_attempt",
    "record",
    "retry_pause",
    "wait_for_room",
]

# Saturations whose reason the backend_saturated state line carries (the words this
# layer's callers may not know from the plain stopwatch).
_SHOWN_WHY = frozenset({"reserve", "too_slow", "incomplete", "first_token"})
# Faults worth a second try of the same backend before commit, after a short random
# pause: a 500, a 502, a 503 or Anthropic's 529 without a Retry-After, and a reset before
# any write of the request went through (not_sent: the backend never had it).
# A reset after the request went out (reason connection_reset) is never tried again:
# the backend may have read it and worked on it (the Forwarder's pool never resends
# either; a stale idle connection is dropped before anything is written on it).
_TRANSIENT = frozenset({"http_500", "http_502", "http_503", "http_529", "not_sent"})
# Refusals that may say when to come back: with a Retry-After the backend gave, waited
# out once per request (within the budget's room, at most max_retry_wait) and retried.
_SAID_WHEN = frozenset({"http_429", "http_503", "http_529"})
_JITTER = 0.25  # a second try waits up to this long more, at random (no herd on one backend)
_SPREAD = 0.1  # callers waiting out one Retry-After come back over this share of it more


class FaultKind(Enum):
    """What a failed attempt tells the next step."""

    HOLDS = "holds"
    """The backend's shared hardware is taken: its ``shares`` group is passed over."""
    TRANSIENT = "transient"
    """Worth a second try of the same backend, after a short random pause."""
    WAIT = "wait"
    """The backend said when (``Retry-After``): waited out once, if there is room."""


@dataclass(frozen=True, slots=True)
class Fault:
    """A failed attempt's word for the next step: its kind and the outcome behind it
    (for :attr:`FaultKind.HOLDS`, the ``shares`` group that is taken)."""

    kind: FaultKind
    reason: str

    @property
    def again(self) -> bool:
        """True when the same backend may be tried again."""
        return self.kind is not FaultKind.HOLDS


# One Fault per retryable outcome, made once.
_FAULTS = {
    (kind, outcome): Fault(kind, outcome)
    for kind, outcomes in ((FaultKind.TRANSIENT, _TRANSIENT), (FaultKind.WAIT, _SAID_WHEN))
    for outcome in outcomes
}


class Tries:
    """One request's second tries: of the current backend, and whether a
    ``Retry-After`` was waited out (once per request)."""

    __slots__ = ("retried", "waited")

    def __init__(self) -> None:
        self.retried = 0
        self.waited = False


async def again(
    req: TierRequest, attempt: Attempt, fault: Fault, pause: float, tries: Tries
) -> Attempt:
    """Count, announce and wait out ``pause``: the same backend's next attempt."""
    tries.retried += 1
    if fault.kind is FaultKind.WAIT:
        tries.waited = True
    route = attempt.route or ""
    labelled(SAME_TIER_RETRIES, route, attempt.backend.name, fault.reason).inc()
    await _pause(req, attempt, pause, fault.reason)
    waited = fault.kind is FaultKind.WAIT
    return Attempt(
        attempt.n,
        attempt.of,
        attempt.backend,
        attempt.route,
        retry=attempt.retry + 1,
        waited=waited,
    )


def next_attempt(req: TierRequest, attempt: Attempt) -> Attempt | None:
    """The attempt after ``attempt``: the next tier, then (when every tier was
    skipped and a Breaker asked for it) one forced try of the soonest; else None."""
    chain = req.chain
    of = len(chain)
    if attempt.force:
        return None
    if attempt.n < of:
        return Attempt(attempt.n + 1, of, chain[attempt.n], req.route)
    skipped = answers.skipped(req)
    if len(skipped) == of and req.try_soonest:
        name = min(skipped, key=lambda b: skipped[b] or 0.0)
        soonest = next(b for b in chain if b.name == name)
        return Attempt(of, of, soonest, req.route, force=True)
    return None


def retry_pause(
    req: TierRequest,
    attempt: Attempt,
    fault: Fault,
    tries: Tries,
    retries: int,
    max_retry_wait: float,
) -> float | None:
    """How long to pause before trying ``attempt``'s backend again, or None: no
    second try (none left, no room in the budget, a Retry-After too far off)."""
    backend = attempt.backend
    limit = retries if backend.retries is None else backend.retries
    if tries.retried >= limit or not may_retry(req, attempt):
        return None
    spread = _JITTER
    after = 0.0
    if fault.kind is FaultKind.WAIT:
        said = req.attempts[-1].retry_after if req.attempts else None
        if tries.waited or said is None or said > max_retry_wait:
            return None
        after = said
        # Every caller the backend told the same thing comes back over a tenth of it
        # more, at random, not all at its first instant.
        spread = max(_JITTER, _SPREAD * said)
    left = req.remaining()
    if left is not None:
        room = left - attempt.reserve
        if after >= room:
            return None  # no room: the later tiers' time is not ours to wait away
        spread = min(spread, (room - after) * 0.5)
    return after + spread * random.random()


async def _pause(req: TierRequest, attempt: Attempt, pause: float, why: str) -> None:
    """Say so, and wait ``pause`` seconds before the same backend is tried again."""
    backend = attempt.backend
    req.emit("retrying", **named(backend), after_s=round(pause, 1), reason=why)
    log_event(
        "dispatch.same_tier_retry",
        route=attempt.route,
        backend=backend.name,
        reason=why,
        after_s=round(pause, 3),
    )
    await asyncio.sleep(pause)


async def wait_for_room(
    room: WaitingRoom,
    priority: bytes | None,
    picker: Picker,
    scope: Scope,
    req: TierRequest,
    route: str,
) -> WaitRefused | None:
    """Wait in the waiting room while every backend of the chain is full (None), or
    the reason the room turns the request away."""
    band = room.default_band
    key = caller_name(scope)
    if priority is not None:
        band = room.band(header(scope["headers"], priority))
        if key is not None and not may_jump(scope):
            band = max(band, room.default_band)  # a key may lower itself, not rise
    chain = req.chain

    async def full() -> bool:
        return await picker.all_full(chain)

    try:
        await room.wait(req, route, full, band, key)
    except WaitRefused as refused:
        return refused
    return None


def record(
    req: TierRequest,
    attempt: Attempt,
    outcome: str,
    retry_after: float | None = None,
    detail: str | None = None,
) -> None:
    elapsed = clock.now() - attempt.started
    backend = attempt.backend
    if backend.pool is None:
        record = AttemptRecord(attempt.n, backend.name, outcome, elapsed, retry_after, detail)
    else:
        record = ReplicaRecord(
            attempt.n, backend.name, outcome, elapsed, retry_after, detail, backend.pool
        )
    req.attempts.append(record)
    metrics = attempt.metrics
    if metrics is None:  # (an attempt never run: skipped, busy)
        metrics = attempt.metrics = attempt_metrics(attempt.route or "", backend.name)
    metrics.attempts(outcome).inc()
    # Every tier so far said "rate limited": Heartbeats holds its commit (a 429 to come).
    if outcome == "http_429" or (outcome == "skipped" and detail == answers.SAID_WHEN_SKIP):
        if len(req.attempts) == 1 or req.rate_limited is not None:
            req.rate_limited = attempt
    else:
        req.rate_limited = None


def failed(req: TierRequest, attempt: Attempt, exc: BaseException, outcome: str) -> Fault | None:
    """Record and announce a failed attempt. Returns what the next step must know: the
    backend's shared hardware is taken (saturated or busy), a fault worth a second
    try, or None."""
    retry: float | None = None
    detail: str | None = None
    if isinstance(exc, BackendSkipped):
        retry = exc.retry_in
        if exc.why == "retry_after":
            detail = answers.SAID_WHEN_SKIP
    elif isinstance(exc, RetryableStatus):
        retry, detail = exc.retry_after, exc.detail
    record(req, attempt, outcome, retry, detail)
    backend = attempt.backend.name
    fields = named(attempt.backend)
    failing_over = not attempt.is_last
    fault: Fault | None = None
    if isinstance(exc, BackendBusy):
        why = "max_in_flight" if exc.why == "max_in_flight" else "status"
        if exc.why.startswith("suspect"):
            why = "suspect"  # an earlier caller's verdict (the watchdog's mark)
        labelled(BACKEND_BUSY, attempt.route or "", backend, why).inc()
        if exc.in_flight is not None:
            fields["in_flight"] = exc.in_flight
        else:
            fields["reason"] = exc.why
        req.emit("backend_busy", **fields, failing_over=failing_over)
        if exc.why != "reserve":  # (passed over for time: its hardware is not known taken)
            fault = _holds(attempt.backend)
    elif isinstance(exc, BackendSkipped):
        req.emit(
            "backend_skipped",
            **fields,
            retry_in_s=None if retry is None else round(retry, 1),
            failing_over=failing_over,
        )
    elif isinstance(exc, BackendSaturated):
        if exc.why in _SHOWN_WHY:
            req.emit("backend_saturated", **fields, reason=exc.why, failing_over=failing_over)
        else:
            req.emit("backend_saturated", **fields, failing_over=failing_over)
        fault = _holds(attempt.backend)
    else:
        req.emit("backend_failed", **fields, reason=outcome, failing_over=failing_over)
        if outcome in _SAID_WHEN and retry is not None:
            fault = _FAULTS[
                FaultKind.WAIT, outcome
            ]  # the backend said when: waited out, if there is room
        elif outcome in _TRANSIENT:
            fault = _FAULTS[FaultKind.TRANSIENT, outcome]
        elif outcome == "http_404":
            _not_found(attempt, failing_over)
    log_event(
        "dispatch.attempt_failed",
        route=attempt.route,
        backend=backend,
        n=attempt.n,
        of=attempt.of,
        outcome=outcome,
        failing_over=failing_over,
    )
    return fault


def _not_found(attempt: Attempt, failing_over: bool) -> None:
    """Log a backend's 404 for a routed path as what it most likely is: a base-URL mistake."""
    url = attempt.backend.url.rstrip("/")
    hint = (
        f"its URL ends in /v1 and the routed paths already start with /v1: "
        f"expected the base URL without /v1 ({url[: -len('/v1')]!r})"
        if url.endswith("/v1")
        else "check the backend's base URL and that it serves this path and model"
    )
    log_event(
        "dispatch.backend_not_found",
        level=logging.WARNING,
        route=attempt.route,
        backend=attempt.backend.name,
        url=url,
        failing_over=failing_over,
        hint=f"likely a base-URL mistake: {hint}",
    )


def named(backend: Backend) -> dict[str, Any]:
    """A state line's naming fields: the backend, and its pool when it has one."""
    if backend.pool is None:
        return {"backend": backend.name}
    return {"backend": backend.name, "pool": backend.pool}


def _holds(backend: Backend) -> Fault | None:
    return None if backend.shares is None else Fault(FaultKind.HOLDS, backend.shares)


def may_retry(req: TierRequest, attempt: Attempt) -> bool:
    """True when a second try of the same backend keeps the reserve (and the budget)."""
    if req.committed or req.cancel_reason is not None:
        return False
    left = req.remaining()
    return left is None or left > attempt.reserve
