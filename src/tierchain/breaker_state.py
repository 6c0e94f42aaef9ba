"""The breaker's state machine, the one every store runs.

:func:`acquire` and :func:`record` are the rules; :class:`~tierchain.MemoryStore` calls them on
its own ledgers, and :class:`~tierchain.RedisStore` runs a Lua transcription of them
(:mod:`tierchain.redis_scripts`), so both stores keep the same semantics. Per (route, backend)
a ledger holds:

- ``state``: ``closed``, ``open`` or ``half_open`` (an open breaker whose
  cooldown has ended becomes half-open the next time anyone looks);
- two consecutive counts, ``failures`` and ``saturations``, cleared by one
  good attempt;
- ``open_until`` (the store's clock), the probe slot (``probe_until`` and the
  token of the probe holding it), and ``gen``, bumped every time the breaker
  opens, so that a verdict from an attempt admitted before the breaker opened
  can neither close it nor extend its cooldown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "PROBE_BUSY_RETRY",
    "BreakerChange",
    "BreakerPolicy",
    "BreakerSnapshot",
    "Ledger",
    "Outcome",
    "Ticket",
    "acquire",
    "failure_wait",
    "record",
    "reopen_cooldown",
    "snapshot",
]

Outcome = Literal["success", "failure", "stream_failure", "saturation", "neutral"]
"""How an attempt ended, for the breaker. ``stream_failure`` is a failure of a
stream that had already reached the caller (it broke or stalled mid-answer): it
counts as a failure and, on a ledger of its own, against
``stream_failure_threshold``. ``neutral`` counts for nothing and only gives
back a probe slot (a 4xx, a cancelled attempt, a spent budget)."""

PROBE_BUSY_RETRY = 1.0
"""``retry_in`` reported while another request holds the half-open probe slot."""


@dataclass(frozen=True, slots=True)
class BreakerSnapshot:
    """One breaker's state as a reader (the operator page) sees it.

    ``state`` is ``"closed"``, ``"open"`` or ``"half_open"``; ``retry_in`` is the
    seconds until a probe may go (only while open, else None); ``failures`` and
    ``saturations`` are the consecutive counts of each ledger; ``reason`` says what
    opened it, while open (``failure``, ``stream_failure``, ``saturation``,
    ``retry_after``; ``""`` otherwise).
    """

    state: str
    retry_in: float | None
    failures: int
    saturations: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    """The numbers a Breaker runs its ledgers with (passed to the store per call)."""

    failure_threshold: int = 5
    failure_cooldown: float = 30.0
    saturation_threshold: int = 2
    saturation_cooldown: float = 900.0
    retry_after_cap: float = 900.0
    probe_lease: float = 300.0
    saturation_backoff: float = 30.0
    """The first cooldown after a half-open probe saturated; it doubles with each
    further re-open, up to ``saturation_cooldown`` (0: always ``saturation_cooldown``)."""
    stream_failure_threshold: int = 2
    """Mid-stream deaths in a row (``stream_failure``) that open the breaker."""
    probe_every: float = 0.0
    """The base of a failure's cooldown: a breaker opened by failures half-opens (its
    recovery probe goes) this long after it opened, and each further failed probe waits one
    ``probe_every`` longer (2, 4, 6 ... s for 2 s), up to ``failure_cooldown`` (Envoy's
    outlier ejection: base ejection time times the ejections in a row, capped). 0: every
    open for failures lasts ``failure_cooldown`` (the Breaker's default is 2 s)."""


@dataclass(frozen=True, slots=True)
class Ticket:
    """The answer to "may this attempt go?".

    ``probe`` is the probe token (0 when this attempt is not the half-open
    probe); hand it and ``gen`` back to :meth:`Store.breaker_record`.
    ``transitions`` lists the states this call moved the breaker into.
    ``clean`` says the breaker was closed with both counts at zero, so a
    success has nothing to clear and need not be recorded. ``reason`` says,
    for a breaker that turned the attempt away (open, or half-open with its probe
    out), what last opened it (``failure``, ``saturation``, ``retry_after``; ``""``
    otherwise).
    """

    admitted: bool
    state: str
    gen: int = 0
    probe: int = 0
    retry_in: float | None = None
    transitions: tuple[str, ...] = ()
    clean: bool = False
    reason: str = ""


@dataclass(frozen=True, slots=True)
class BreakerChange:
    """The breaker after an outcome was recorded; ``reason`` says what opened it."""

    state: str
    retry_in: float | None
    failures: int
    saturations: int
    transitions: tuple[str, ...] = ()
    reason: str = ""


@dataclass(slots=True)
class Ledger:
    """The mutable state of one breaker (see the module docstring)."""

    state: str = "closed"
    failures: int = 0
    saturations: int = 0
    open_until: float = 0.0
    probe_until: float = 0.0
    probe_token: int = 0
    gen: int = 0
    reason: str = ""
    reopens: int = 0  # failed probes since the breaker last closed (the backoff's step)
    stream_failures: int = 0


def reopen_cooldown(policy: BreakerPolicy, reopens: int) -> float:
    """The cooldown of a breaker re-opened by a saturated probe, after ``reopens`` earlier ones."""
    if policy.saturation_backoff <= 0:
        return policy.saturation_cooldown
    return min(policy.saturation_cooldown, policy.saturation_backoff * 2.0 ** min(reopens, 60))


def failure_wait(policy: BreakerPolicy, reopens: int) -> float:
    """The cooldown of a breaker opened by failures after ``reopens`` failed probes in a row:
    ``probe_every`` times the opens in the streak, capped at ``failure_cooldown``."""
    if policy.probe_every <= 0:
        return policy.failure_cooldown
    return min(policy.failure_cooldown, policy.probe_every * (reopens + 1))


def _settle_time(led: Ledger, now: float, transitions: list[str]) -> None:
    if led.state == "open" and now >= led.open_until:
        led.state = "half_open"
        transitions.append("half_open")


def acquire(
    led: Ledger, now: float, policy: BreakerPolicy, *, force: bool = False, wake: bool = False
) -> Ticket:
    """May an attempt go now? Takes the probe slot when half-open and free.

    ``wake`` says the backend's status reports idle: a breaker open for
    saturation ends its cooldown now (and this attempt may be its probe).
    """
    transitions: list[str] = []
    if wake and led.state == "open" and led.reason == "saturation" and now < led.open_until:
        led.open_until = now
    _settle_time(led, now, transitions)
    done = tuple(transitions)
    if led.state == "closed" or force:
        clean = led.state == "closed" and not led.failures and not led.saturations
        return Ticket(True, led.state, led.gen, 0, None, done, clean)
    if led.state == "half_open":
        if led.probe_until <= now:
            led.probe_token += 1
            led.probe_until = now + policy.probe_lease
            return Ticket(True, "half_open", led.gen, led.probe_token, None, done)
        # (The reason it last opened: callers skipped while a probe after a backend's
        # own Retry-After is out still hear 429, as while it cooled down.)
        return Ticket(False, "half_open", led.gen, 0, PROBE_BUSY_RETRY, done, reason=led.reason)
    return Ticket(False, "open", led.gen, 0, led.open_until - now, done, reason=led.reason)


def record(
    led: Ledger,
    now: float,
    policy: BreakerPolicy,
    outcome: Outcome,
    *,
    gen: int,
    probe: int = 0,
    retry_after: float | None = None,
) -> BreakerChange:
    """Apply one attempt's outcome to the ledger."""
    transitions: list[str] = []
    _settle_time(led, now, transitions)
    if probe and probe == led.probe_token:
        led.probe_until = 0.0
    fresh = gen == led.gen
    if outcome == "success":
        if fresh:
            led.failures = led.saturations = led.stream_failures = 0
            if led.state != "closed":
                led.state = "closed"
                led.open_until = led.probe_until = 0.0
                led.reason = ""
                led.reopens = 0
                transitions.append("closed")
    elif outcome == "failure" or outcome == "stream_failure" or outcome == "saturation":
        if outcome != "saturation":
            led.failures += 1
            kind_cooldown = failure_wait(policy, 0)
            tripped = led.failures >= policy.failure_threshold
            if outcome == "stream_failure":
                led.stream_failures += 1
                streams = led.stream_failures >= policy.stream_failure_threshold
                if not tripped and streams:
                    tripped = True
                else:
                    outcome = "failure"  # (the reason: the failures' own threshold)
        else:
            led.saturations += 1
            kind_cooldown = policy.saturation_cooldown
            tripped = led.saturations >= policy.saturation_threshold
        cooldown = kind_cooldown if tripped else 0.0
        reason: str = outcome
        hinted = 0.0
        if retry_after is not None:
            hinted = min(retry_after, policy.retry_after_cap)
            if not tripped or hinted > cooldown:
                reason = "retry_after"
            tripped = True
            cooldown = max(cooldown, hinted)
        if led.state != "closed":
            # The probe (or a forced attempt) failed: re-open. A verdict from an
            # attempt admitted before the breaker opened is counted, nothing more.
            tripped = fresh
            # Re-opens grow: one slow probe after a hiccup must not cost the whole
            # saturation cooldown (it doubles from saturation_backoff), and a failed
            # probe waits one probe_every longer than the last (Envoy's ejection backoff).
            if outcome == "saturation":
                cooldown = max(hinted, reopen_cooldown(policy, led.reopens))
            else:
                cooldown = max(hinted, failure_wait(policy, led.reopens + 1))
            if fresh:
                led.reopens += 1
        if tripped:
            if led.state != "open":
                led.gen += 1
                led.probe_until = 0.0
                transitions.append("open")
            led.state = "open"
            if now + cooldown > led.open_until:
                led.open_until = now + cooldown
                led.reason = reason
    return BreakerChange(
        led.state,
        led.open_until - now if led.state == "open" else None,
        led.failures,
        led.saturations,
        tuple(transitions),
        led.reason,
    )


def snapshot(led: Ledger | None, now: float) -> BreakerSnapshot:
    """What a reader sees, without changing anything."""
    if led is None:
        return BreakerSnapshot("closed", None, 0, 0)
    state = led.state
    if state == "open" and now >= led.open_until:
        state = "half_open"
    if state != "open":
        return BreakerSnapshot(state, None, led.failures, led.saturations)
    return BreakerSnapshot(state, led.open_until - now, led.failures, led.saturations, led.reason)
