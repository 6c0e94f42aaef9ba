"""The per-request object every tierchain layer talks through.

One :class:`TierRequest` lives in the ASGI scope under :data:`SCOPE_KEY`. The
first layer that needs it creates it (:meth:`TierRequest.of`); later layers find
the same one. It carries:

- the route and the chain (after preference and pins),
- the current :class:`Attempt` (n of N, backend, deadline),
- the budget's deadline,
- the attempt trail, and
- a channel of state events (:meth:`TierRequest.emit`), which Heartbeats turns
  into SSE comment lines and anything else may listen to,
- the current attempt's :class:`~tierchain.observer.Observer`, and the typed
  facts the layers share (why an attempt failed, why it was cancelled, whether
  the response has started).

A host handler needs exactly one call: :func:`current_attempt`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from ._disconnect import DisconnectGuard, Young
from ._runtime import clock
from ._runtime.deadlines import EARLY
from ._runtime.interrupt import Interruption
from ._types import Receive, Scope, Send
from .backend import Backend
from .errors import AttemptError
from .observer import Observer
from .telemetry import AttemptMetrics, tracing_enabled

__all__ = [
    "DEFAULT_SEND_TIMEOUT",
    "SCOPE_KEY",
    "TRAIL_HEADER",
    "UNROUTED_KEY",
    "Attempt",
    "AttemptRecord",
    "Preference",
    "Reorder",
    "ReplicaRecord",
    "StateEvent",
    "TierRequest",
    "current_attempt",
    "format_trail",
]

DEFAULT_SEND_TIMEOUT = 30.0
"""How long one send to the caller may be out before the caller counts as stalled."""

SCOPE_KEY = "tierchain.request"
"""The scope key under which the :class:`TierRequest` lives."""

UNROUTED_KEY = "tierchain.unrouted"
"""Set (True) in the scope by Failover for a request it does not route (a GET, a
health check): per-attempt layers inside it let such requests straight through."""

StateEvent = dict[str, Any]
"""A state event: a JSON-able dict with at least a ``state`` field."""

Reorder = Callable[[str, tuple[Backend, ...]], Awaitable[tuple[Backend, ...]]]
"""Given a route and its chain, return the same backends in another order."""

Listener = Callable[[StateEvent], None]


def _started() -> float:
    return clock.now()


@dataclass(slots=True)
class Attempt:
    """One try of one backend for one request: ``n`` of ``of``.

    ``deadline`` is the monotonic time by which this attempt must end because
    the request's budget ends then (None: no budget). ``force`` asks an open
    breaker to let this attempt through anyway (the "try the soonest" policy).
    ``reserve`` is the time this attempt leaves for the later tiers (set by the
    SaturationWatchdog: 0 for the last tier or without a budget); ``verdict``
    is the watchdog's latest word on the backend (``working``, ``too_slow``...).
    ``retry`` counts the tries of the same backend before this one in the same
    request (Failover's ``retries``, after a transient fault). ``waited``: this
    try follows a ``Retry-After`` the backend gave and the request waited out;
    a half-open breaker lets it through beside its probe (the backend said when).
    """

    n: int
    of: int
    backend: Backend
    route: str | None = None
    deadline: float | None = None
    started: float = field(default_factory=_started)
    force: bool = False
    reserve: float = 0.0
    verdict: str | None = None
    retry: int = 0
    waited: bool = False
    metrics: AttemptMetrics | None = field(default=None, repr=False, compare=False)
    """Its labelled metric children, resolved once for its route and backend (Failover)."""

    def remaining(self) -> float | None:
        """Seconds left before the budget ends this attempt, or None without a budget."""
        if self.deadline is None:
            return None
        return self.deadline - clock.now()

    @property
    def is_last(self) -> bool:
        """True when there is no later tier to fail over into."""
        return self.n >= self.of


TRAIL_HEADER = b"x-tierchain-attempts"
"""The response header carrying the attempt trail: ``tower;outcome=connect_refused, ...``."""


def format_trail(records: list[AttemptRecord], extra: tuple[str, str] | None = None) -> bytes:
    """The trail header's value for ``records`` (plus an attempt still running, ``extra``).

    A replica of a pool is listed with its pool: ``tower-a;pool=tower;outcome=ok``
    (``extra``'s name then carries its ``;pool=`` already)."""
    if not records and extra is not None:  # the usual case: the first tier answered
        return f"{extra[0]};outcome={extra[1]}".encode()
    parts = [
        f"{r.backend};outcome={r.outcome}"
        if r.pool is None
        else f"{r.backend};pool={r.pool};outcome={r.outcome}"
        for r in records
    ]
    if extra is not None:
        parts.append(f"{extra[0]};outcome={extra[1]}")
    return ", ".join(parts).encode()


# Not ``frozen``: a frozen dataclass's ``__init__`` sets each field through
# ``object.__setattr__`` (a slot wrapper called with a tuple of its arguments), about 7 k
# instructions for the record every request makes (docs/benchmarks.md). A record is set up by
# its own ``__init__`` and never assigned to after; ``unsafe_hash`` keeps it hashable, by the
# same fields, as the frozen one was.
@dataclass(slots=True, unsafe_hash=True)
class AttemptRecord:
    """How one attempt ended, for the trail header, the error body and the demo.

    ``retry_after`` is when the backend (its ``Retry-After``) or its breaker said
    to come back, in seconds; ``detail`` is the backend's own message, if any;
    ``pool`` the pool the backend is a replica of (None: a backend on its own;
    a replica's record is a :class:`ReplicaRecord`). Made once, when the attempt
    ends, and not changed after.
    """

    n: int
    backend: str
    outcome: str
    elapsed: float
    retry_after: float | None = None
    detail: str | None = None
    pool: ClassVar[str | None] = None


@dataclass(slots=True, unsafe_hash=True)
class ReplicaRecord(AttemptRecord):
    """How one attempt at a pool's replica ended: an :class:`AttemptRecord` with its ``pool``
    (a record of its own, so that a backend alone pays nothing for the field)."""

    pool: str | None = None  # type: ignore[misc]


@dataclass(slots=True, frozen=True)
class Preference:
    """What PreferBackend made of the request's preference header."""

    requested: str
    applied: bool
    reason: str


class BodyPass(Protocol):
    """A layer outside Failover that only notes a response's start and passes its body on
    (Budget inside a chain), as :attr:`TierRequest.body_pass`. Failover, holding that
    layer's ``inward`` send, notes the start for it (``started``) and hands the start and a
    going stream's chunks to ``passes_to``, a call less each; the last chunk goes through
    the layer. None again when the layer's request ends."""

    inward: Send
    """The send the layer handed inward (Failover's, when no layer wraps it between)."""
    passes_to: Send
    """The send the layer passes every message to."""
    started: bool
    """The layer's note that the response started (set by Failover when it sends the
    start past the layer)."""


class BodyWatch(Protocol):
    """A layer outside Failover that watches the request body only to learn what it says
    (Heartbeats: its ``"stream"``, its end), as :attr:`TierRequest.body_watch`. When the
    receive Failover holds is that layer's own, Failover reads the body from the layer's
    ``outer_receive`` and tells it (``body_read``), a coroutine less a request. None again
    when the layer's request ends."""

    inward_receive: Receive
    """The receive the layer handed inward (Failover's, when no layer wraps it between)."""
    outer_receive: Receive
    """The receive the layer watches."""

    def body_read(self, body: bytes) -> None:
        """Failover read the whole ``body`` from ``outer_receive``, past the layer."""


class TierRequest:
    """Per-request state shared by the tierchain layers. See the module docstring."""

    __slots__ = (
        "_listeners",
        "aborted",
        "attempt",
        "attempt_error",
        "attempts",
        "body",
        "body_pass",
        "body_watch",
        "budget",
        "caller_blocked_since",
        "caller_unblocked_at",
        "cancel_reason",
        "chain",
        "committed",
        "continuable",
        "continuation",
        "deadline",
        "guard",
        "in_chain",
        "interruption",
        "observer",
        "pin",
        "preference",
        "rate_limited",
        "reorderers",
        "route",
        "send_timeout",
        "started",
        "state",
        "streaming",
        "traced",
        "try_soonest",
        "wire",
        "young",
    )

    def __init__(self) -> None:
        self.route: str | None = None
        self.chain: tuple[Backend, ...] = ()
        self.attempt: Attempt | None = None
        self.attempts: list[AttemptRecord] = []
        self.deadline: float | None = None
        self.budget: float | None = None
        """The whole budget in seconds (set by Budget with :attr:`deadline`)."""
        self.body: bytes | None = None
        self.streaming: bool | None = None
        self.in_chain = False
        self.reorderers: list[Reorder] = []
        self.state: StateEvent | None = None
        self.started = clock.now()
        self.traced = tracing_enabled()
        """Whether an OpenTelemetry SDK traces (read once, when the request begins): the
        layers make their spans only then."""
        self._listeners: list[Listener] = []
        self.observer: Observer | None = None
        """The current attempt's response facts (set by Failover per attempt)."""
        self.committed = False
        """True once a response has started towards the caller (Failover's commit)."""
        self.continuable = False
        """True once Failover committed a stream it could continue on a later tier (the
        watchdog then cuts it at the reserve's point, for that tier to finish it)."""
        self.continuation: Any = None
        """Failover's: a broken stream being finished on a later tier (None: none is)."""
        self.attempt_error: AttemptError | None = None
        """Why the current attempt failed, left by the layer that knew (a Forwarder
        that could not connect, a stream found malformed) where a framework might
        otherwise turn it into a plain 500."""
        self.aborted = False
        """True while the current attempt is being cancelled by :meth:`abort`."""
        self.guard: DisconnectGuard | None = None
        """Failover's disconnect guard, once entered: work that only a request living
        ``WATCH_AFTER`` seconds needs waits for it (:attr:`DisconnectGuard.then`)."""
        self.young: Young | None = None
        """The request's first ``WATCH_AFTER`` seconds (:class:`~tierchain._disconnect.Young`),
        started and closed by the outermost layer that has the request (Heartbeats,
        Budget): their deadlines, and the guard's, wait for its end. None: no such layer
        runs, or the request is over."""
        self.interruption: Interruption | None = None
        """How :meth:`abort` (and Failover's send timeout) cancel the request's task: armed
        by Failover on entry, so that only their own cancellation is undone."""
        self.cancel_reason: str | None = None
        """The outcome word for an attempt an outer layer cancelled (``budget_exhausted``)."""
        self.try_soonest = False
        """An inner Breaker asks for one forced attempt when every backend is open."""
        self.pin: str | None = None
        """The backend an operator pin moved to the front, if any."""
        self.preference: Preference | None = None
        """What became of the caller's preference header, if it sent one."""
        self.caller_blocked_since: float | None = None
        """While a send to the caller is out (the relay handing it a chunk), when it
        started (monotonic seconds); None while none is. A caller that stops reading
        keeps that send out: meanwhile nothing is read from the upstream, so its
        silence is not the upstream's (the watchdog's stall gap skips it), and past
        Failover's ``send_timeout`` the caller is cut. Left set when the send never
        came back (the request ended while the caller was not reading)."""
        self.send_timeout: float | None = DEFAULT_SEND_TIMEOUT
        """How long a send to the caller may be out before the caller is cut (Failover's
        ``send_timeout``; None: no bound). Also bounds the last writes of the layers
        outside Failover (Budget's and Heartbeats' error events)."""
        self.caller_unblocked_at = 0.0
        """When the last send to the caller came back (monotonic seconds; 0: none yet):
        the upstream's silence is timed from then at the earliest."""
        self.body_pass: BodyPass | None = None  # (see BodyPass)
        self.body_watch: BodyWatch | None = None  # (see BodyWatch)
        self.rate_limited: Attempt | None = None
        """While every attempt recorded so far was refused with 429 or skipped for a
        backend's own ``Retry-After`` (Failover's records), the last of them; None
        otherwise. Heartbeats holds its own commit
        meanwhile, so that a caller every tier refused gets HTTP 429 its SDK retries."""
        self.wire: str | None = None
        """The request's wire format (:mod:`tierchain.wire`), set by Failover from the
        route or the path; a backend's own ``wire_format`` wins for its attempts."""

    @classmethod
    def of(cls, scope: Scope) -> TierRequest:
        """The request's object, created and stored in ``scope`` on first use."""
        req: TierRequest | None = scope.get(SCOPE_KEY)
        if req is None:
            req = scope[SCOPE_KEY] = cls()
        return req

    @classmethod
    def find(cls, scope: Scope) -> TierRequest | None:
        """The request's object if some layer created it, else None."""
        return scope.get(SCOPE_KEY)

    # -- the state channel -------------------------------------------------

    def emit(self, state: str, **fields: Any) -> StateEvent:
        """Publish a state event (``{"state": state, **fields}``) to every listener.

        The latest event is kept in :attr:`state` so a keepalive can repeat it.
        A listener that raises is dropped from nothing and breaks nothing: its
        exception is swallowed, because a display must never fail a request.
        """
        event: StateEvent = {"state": state, **fields}
        self.state = event
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a broken listener must not break a request
                pass
        return event

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(event)`` for every later event; returns the unsubscribe."""
        self._listeners.append(listener)
        return lambda: self.unsubscribe(listener)

    def listen(self, listener: Listener) -> None:
        """:meth:`subscribe` with no unsubscribe made (a listener for the request's life,
        or one that calls :meth:`unsubscribe` itself)."""
        self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        """Stop calling ``listener`` (nothing happens if it is not listening)."""
        try:
            self._listeners.remove(listener)
        except ValueError:
            pass

    def abort(self, error: AttemptError) -> None:
        """End the current attempt with ``error`` from inside a ``send`` call.

        The running task is cancelled (a cancellation passes through any
        framework's exception handling untouched) and the layer that owns the
        attempt finds ``error`` in :attr:`attempt_error`.
        """
        self.attempt_error = error
        if self.aborted:
            return  # already on its way out
        self.aborted = True
        interruption = self.interruption
        if interruption is None:  # no Failover armed one: the running task's
            if asyncio.current_task() is None:
                return
            interruption = self.interruption = Interruption.on()
        interruption.interrupt(f"tierchain: {error.reason}")

    def after_young(self, started: float, due: float, arm: Callable[[], object]) -> Young | None:
        """A layer's deadline at ``due``, which ``arm`` arms (checking first that the
        layer's part of the request is not over): armed now, or at the end of the
        request's :attr:`young` phase when due later (the one rule of what may wait for
        it; the guard joins it by its own, ``DisconnectGuard.enter``). Without a phase
        (the outermost layer), one is started at ``started`` and returned: the caller
        gives it back to :meth:`end_young` when the request ends."""
        young = self.young
        made = None
        if young is None:
            young = made = self.young = Young(started)
        then = young.then
        # (Within the scheduler's EARLY of the phase's end, it would be called at the same
        # wake: armed now, so that it falls due at its own time.)
        if then is None or due <= young.ends + EARLY:
            arm()
        else:
            then.append(arm)
        return made

    def end_young(self, young: Young | None) -> None:
        """The request is over for the layer that started ``young`` (None: it did not)."""
        if young is not None:
            young.close()
            self.young = None

    def remaining(self) -> float | None:
        """Seconds left of the request's budget, or None when it has none."""
        if self.deadline is None:
            return None
        return self.deadline - clock.now()


def current_attempt(scope: Scope) -> Attempt:
    """Where this attempt should go: the one call a host's forwarding handler needs.

    Raises ``RuntimeError`` with a one-sentence fix when no ``Failover`` runs
    in front of the handler.
    """
    req: TierRequest | None = scope.get(SCOPE_KEY)
    if req is None or req.attempt is None:
        raise RuntimeError(
            "tierchain.current_attempt() found no attempt in this request: add "
            "Failover(app, routes=...) in front of this handler (or give Forwarder a backend=)."
        )
    return req.attempt
