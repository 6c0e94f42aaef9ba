"""Exceptions that travel between the tierchain layers.

An inner layer (Breaker, SaturationWatchdog, Forwarder, or a host handler)
raises an :class:`AttemptError` to say "this attempt produced no usable answer";
:class:`~tierchain.Failover` catches it and advances the chain. A spent budget
is a different fact and a different branch of the tree::

    TierchainError
    ├── AttemptError            this attempt is over; try the next tier
    │   ├── BackendSkipped      the breaker is open; the backend was not touched
    │   ├── BackendBusy         the backend has no room now (in-flight limit or its
    │   │                       status): skipped before sending, not a failure
    │   ├── BackendSaturated    no first chunk within the window (the watchdog)
    │   ├── BackendUnavailable  refused, reset, connect timeout, broken stream
    │   ├── StreamError         the stream went wrong: no_data, truncated, stalled,
    │   │                       malformed_stream
    │   ├── RetryableStatus     a retryable status arrived before anything was sent
    │   └── CallerStalled       the caller stopped reading past send_timeout: the
    │                           request is cut, never counted against the backend
    ├── BudgetExhausted         the request's deadline is spent: 504, never a failover
    ├── BodyTooLarge            the request body exceeds what can be replayed: 413
    ├── ResolveError            (also a ValueError) a resolver found no route in the
    │                           body: 400
    ├── StoreUnavailable        (also a ConnectionError) the shared store is away and
    │                           the operation (a pin write) has no safe fallback: 503
    └── ConfigError             (also a ValueError) the configuration cannot be used;
                                ``problems`` lists every reason

Every ``AttemptError`` carries ``reason``, the short outcome word used in the
attempt trail, metrics and heartbeat lines. The last three are the ones
application code catches: ``ResolveError`` from a custom resolver,
``StoreUnavailable`` from :meth:`RedisStore.set_pin <tierchain.RedisStore.set_pin>`
and friends, ``ConfigError`` from :func:`tierchain.config.from_env`. Each keeps
its built-in base, so ``except ValueError`` still catches a ``ConfigError``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "AttemptError",
    "BackendSaturated",
    "BackendSkipped",
    "BackendUnavailable",
    "BodyTooLarge",
    "BudgetExhausted",
    "CallerStalled",
    "ConfigError",
    "ResolveError",
    "RetryableStatus",
    "StoreUnavailable",
    "StreamError",
    "TierchainError",
]


class TierchainError(Exception):
    """Base class of every exception tierchain raises on purpose."""


class AttemptError(TierchainError):
    """This attempt produced no usable answer; the chain may advance."""

    reason: str = "error"

    def __init__(self, message: str = "", *, reason: str | None = None) -> None:
        super().__init__(message or (reason or self.reason))
        if reason is not None:
            self.reason = reason


class BackendSkipped(AttemptError):
    """The backend's breaker is open: the attempt was skipped without touching it."""

    reason = "skipped"

    def __init__(self, message: str = "", *, retry_in: float | None = None, why: str = "") -> None:
        super().__init__(message)
        self.retry_in = retry_in
        self.why = why  # what opened the breaker (``retry_after``: the backend said when)


class BackendBusy(AttemptError):
    """The backend has no room now: skipped before anything was sent to it.

    Busy is not a failure: no breaker ledger counts it. ``in_flight`` is the
    number of attempts in flight at the backend when it was skipped (None when
    its status said full), and ``why`` says which: ``max_in_flight`` or the
    status reader's account (``"3 waiting"``, ``"kv_cache 0.85"``, ``"all slots busy"``).
    """

    reason = "busy"

    def __init__(
        self, message: str = "", *, in_flight: int | None = None, why: str = "max_in_flight"
    ) -> None:
        super().__init__(message)
        self.in_flight = in_flight
        self.why = why


class BackendSaturated(AttemptError):
    """The backend accepted the request but produced no first chunk in time.

    ``why`` is the watchdog's word for it (``no_first_chunk``, ``reserve``,
    ``too_slow``, ``no_progress``, ``queued``, ``incomplete``, ``ceiling``...).
    """

    reason = "saturated"

    def __init__(
        self, message: str = "", *, waited: float | None = None, why: str | None = None
    ) -> None:
        super().__init__(message)
        self.waited = waited
        self.why = why


class BackendUnavailable(AttemptError):
    """The backend could not be reached or broke the connection.

    ``reason`` is one of ``connect_refused``, ``connect_timeout``,
    ``connection_reset``, ``not_sent``, ``stream_broken``, ``protocol_error`` or
    ``pool_timeout``. ``gateway_fault`` is True when the gateway itself caused
    it (a wait for a pooled connection, or a connect timeout while the
    gateway's event loop was running late): the chain still advances, but no
    breaker counts it against the backend.
    """

    reason = "unavailable"

    def __init__(
        self, message: str = "", *, reason: str | None = None, gateway_fault: bool = False
    ) -> None:
        super().__init__(message, reason=reason)
        self.gateway_fault = gateway_fault


class StreamError(AttemptError):
    """The backend's stream went wrong; a failure of the backend, not of the caller.

    ``reason`` is one of ``no_data`` (an event stream that ended, or carried only
    comments or garbage, before any data event), ``truncated`` (ended without its
    terminator), ``stalled`` (no data event for ``stall_after`` seconds) or
    ``malformed_stream`` (an event grew past the limit without ending).
    """

    reason = "malformed_stream"


class RetryableStatus(AttemptError):
    """The backend answered a retryable status before anything reached the caller.

    ``retry_after`` is the backend's ``Retry-After`` in seconds (None: not given)
    and ``detail`` the message its body gave, if any.
    """

    def __init__(
        self, status: int, *, retry_after: float | None = None, detail: str | None = None
    ) -> None:
        super().__init__(f"backend answered {status}", reason=f"http_{status}")
        self.status = status
        self.retry_after = retry_after
        self.detail = detail


class BudgetExhausted(TierchainError):
    """The whole request's deadline is spent. Answered with 504; never a failover."""


class CallerStalled(AttemptError):
    """The caller stopped reading: a send to it was out for longer than Failover's
    ``send_timeout``. The request is cut (the server drops the connection), its
    lease and slot are given back, and no breaker counts it: the backend was
    waiting on the caller, not the other way round. ``reason`` is ``caller_stalled``.
    """

    reason = "caller_stalled"


class BodyTooLarge(TierchainError):
    """The request body is larger than the limit that can be buffered and replayed."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds the {limit}-byte limit")
        self.limit = limit


class ResolveError(TierchainError, ValueError):
    """Raised by a resolver when the body cannot name a route: answered 400."""


class StoreUnavailable(TierchainError, ConnectionError):
    """The shared store cannot be reached, and this operation (a pin write) has no safe fallback."""


class ConfigError(TierchainError, ValueError):
    """The configuration cannot be used; ``problems`` lists every reason, one sentence each."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"tierchain configuration has {len(self.problems)} problem(s):\n{lines}")
