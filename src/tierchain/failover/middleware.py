"""Failover: own the chain, call the inner app once per attempt.

Per request: buffer the body (at most ``max_body``; 413 beyond), resolve the
route (404 for an unknown model, 400 for a body that cannot name one), apply
any reorderings that outer layers registered (PreferBackend, pins) while
refusing any that would drop a backend, then try the chain in order.

Each attempt gets one :class:`~tierchain.observer.Observer`, fed by this
layer's ``send`` wrapper and read by every layer inside (Breaker,
SaturationWatchdog) and outside (Budget, Heartbeats). The caller only ever
receives whole events: an event is passed on once its blank line arrived.

An attempt's ``http.response.start`` is held back until it is worth sending:

- an event stream: until its first complete data event (comments before it
  are held with it, up to 64 KiB); an NDJSON stream (Ollama's): until its
  first complete line;
- any other answer: until it is complete (up to ``hold_limit`` bytes; a larger
  one streams on from there), so one cut short, stalled or reset fails over
  without the caller noticing;
- a retryable status (429, 5xx, Anthropic's 529): never; its ``Retry-After``
  and message are kept, and the same backend is tried again (a 500, 502, 503
  or 529 after a short random pause; a ``Retry-After`` within the budget's
  room waited out once, with a ``retrying`` state line) or the chain advances;
- a 404 for a routed path: never; the backend does not serve what its route
  sends it (most often a base URL that ends in ``/v1``), a fault of the backend's
  configuration, not the caller's answer: the chain advances (outcome
  ``http_404``, a breaker failure) and ``dispatch.backend_not_found`` names the
  likely base-URL mistake;
- a 400 that says the request does not fit the model's context window
  (:func:`tierchain.wire.context_exceeded`), while a later tier exists: the
  chain advances with outcome ``context_exceeded``, not a breaker failure.
  Every other 400 passes straight through.

Until then the attempt may still fail over: on an
:class:`~tierchain.errors.AttemptError` (raised, or left in
``TierRequest.attempt_error`` by a layer that knew), any other exception, a
retryable status, or an event stream that ends with no data event
(``no_data``). After the first byte has gone to the caller there is no
failover. A stream that breaks or stalls while a later tier exists is
*continued* instead (``continuations``): the next tier gets the caller's request
with the partial answer in it (:mod:`tierchain.failover.continuation`), and its events are
spliced into the caller's stream in the first tier's envelope
(:mod:`tierchain.failover.continuing`); if it cannot finish the answer, the caller gets the original
break. Otherwise a later failure (``stream_broken``, ``truncated``, ``stalled``,
``malformed_stream``) drops any partial event and ends the stream with an error
in the request's wire format (``WireFormat.error_bytes``, :mod:`tierchain.formats`: an OpenAI
error event, an Anthropic ``event: error``, a Responses ``error`` event, an
NDJSON ``{"error": ...}`` line), and aborts any other body (the server then closes
the connection, so the caller sees an incomplete response rather than a
silently short one). Either way it counts against the backend.

When every tier refused with 429 or 503 the caller gets 429 (503 if any tier
said 503, or a breaker was open for another reason than the backend's own
``Retry-After``) with the soonest ``Retry-After`` any tier gave and each
tier's message; otherwise 502 listing every attempt.


"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any

from opentelemetry.trace import INVALID_SPAN, Span, Status, StatusCode

from .. import _json
from .._body import DEFAULT_BODY_TIMEOUT, read_or_refuse, timeout_option
from .._checks import count, duration
from .._disconnect import DisconnectGuard
from .._head import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS, HeadLimits, refuse_request
from .._runtime import clock
from .._runtime.interrupt import Interruption
from .._target import BadTarget, refuse, request_target
from .._types import ASGIApp, Message, Receive, Scope, Send
from ..admission import Admission
from ..backend import Backend, Routes
from ..errors import (
    BudgetExhausted,
    ResolveError,
)
from ..keys import caller_name
from ..pick_policy import PolicyOption, resolve_policy
from ..picker import Picker, PickWeights
from ..prefill import Prefills
from ..request import (
    DEFAULT_SEND_TIMEOUT,
    UNROUTED_KEY,
    Attempt,
    TierRequest,
)
from ..status import StatusBoard, board_within
from ..telemetry import (
    ATTR_OUTCOME,
    ATTR_ROUTE,
    start_span,
)
from ..waiting import WaitingRoom
from ..wire import recognise
from .answers import Refusal, all_failed, gave_up, refuse_route, turned_away
from .attempt import Responder, call_inner
from .continuing import Continuing
from .hedging import Hedging, Race
from .plan import Fault, Tries, again, next_attempt, record, retry_pause, wait_for_room
from .pools import PoolPlan, gathered, sibling_left
from .route import Resolver, ScopeCopy, Shape, reordered, route_of, shape_of

__all__ = ["DEFAULT_RETRY_STATUSES", "DEFAULT_SEND_TIMEOUT", "Failover", "ResolveError", "Resolver"]

DEFAULT_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504, 529})
"""Statuses that advance the chain before commit (529: Anthropic's "overloaded")."""
_SHAPED = 2 * _json.MAX_CONTAINERS  # bodies longer than this have their shape checked
_WAIT_POLL = 0.25  # how often the first in the waiting room looks again unwoken


def _request_span(req: TierRequest, route: str) -> Span:
    """The request's span (no SDK, the usual case: neither start_span's frame nor its
    attributes)."""
    if not req.traced:
        return INVALID_SPAN
    return start_span("tierchain.request", {ATTR_ROUTE: route, "gen_ai.request.model": route})


class Failover:
    """Own the chain: one call of the inner app per attempt, until one answers.

    ``routes`` maps each logical model to its chain of backends. Failover buffers the
    body, resolves the route, skips a backend that is full, retries a transient fault,
    and moves on to the next tier until an attempt's first chunk reaches the caller; every
    response carries the attempt trail ``x-tierchain-attempts``.

    Options: [Failover options](failover.md#options).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        routes: Routes | Mapping[str, Any],
        max_body: int = 32 * 2**20,
        resolve: Resolver | None = None,
        retry_statuses: Collection[int] = DEFAULT_RETRY_STATUSES,
        paths: Collection[str] = ("/",),
        hold_limit: int = 16 * 2**20,
        store: Any = None,
        lease: float | timedelta = 30.0,
        max_headers: int = DEFAULT_MAX_HEADERS,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        body_timeout: float | timedelta | None = DEFAULT_BODY_TIMEOUT,
        send_timeout: float | timedelta | None = DEFAULT_SEND_TIMEOUT,
        pick: PickWeights | None = None,
        pick_policy: PolicyOption | None = None,
        retries: int = 1,
        max_retry_wait: float | timedelta = 10.0,
        waiting_room: bool = False,
        max_wait: float | timedelta = 30.0,
        priority_header: str | None = None,
        priority_bands: Sequence[str] = ("high", "normal", "low"),
        status_board: StatusBoard | None = None,
        continuations: int = 1,
        max_waiting: int = 256,
        waiting_key_share: float = 0.25,
        hedge_after: float | timedelta | None = None,
    ) -> None:
        self.app = app
        # [hedge] checked seconds (0 or None: off, the default); the policy only when on
        self.hedge_after = Hedging.checked(hedge_after)
        self.hedging = Hedging.build(self.hedge_after)
        self._head = HeadLimits(max_headers, max_header_bytes)
        self.body_timeout = timeout_option("body_timeout", body_timeout)
        self.send_timeout = timeout_option("send_timeout", send_timeout)
        # Matched against the normalised raw path: routers (a Litestar mount) rewrite
        # scope["path"], and the Forwarder sends the same normalised path upstream.
        self.paths = tuple(p.encode() for p in paths)
        self.routes = routes if isinstance(routes, Routes) else Routes(routes)
        self.max_body = count("max_body", max_body, minimum=0)
        self.hold_limit = count("hold_limit", hold_limit, minimum=0)
        self.resolve = resolve
        self.retry_statuses = frozenset(retry_statuses)
        self._known = ", ".join(sorted(self.routes))
        # Each route's chain, and the wire formats set per route (else each request's path
        # says), read once: a Routes does not change once made.
        self._chains = {route: self.routes[route] for route in self.routes}
        self._formats = {
            route: wire for route in self.routes if (wire := self.routes.wire_format(route))
        }
        self.admission = Admission(store, lease=lease)
        # Which backends continue a trailing assistant message (found out, remembered).
        self.prefills = Prefills(store)
        self.status_board, self.picker = self._picker(app, store, pick, pick_policy, status_board)
        self.retries = count("retries", retries, minimum=0)
        self.max_retry_wait = duration("max_retry_wait", max_retry_wait, allow_zero=True)
        self.max_wait = duration("max_wait", max_wait)
        self.continuations = count("continuations", continuations, minimum=0)
        # The routes whose committed streams may be continued on a later tier, and how
        # often per request (a route's own ``continuations`` in Routes wins).
        self.continuable = {
            route: n
            for route in self.routes
            if len(self.routes[route]) > 1
            and (n := self.routes.continuations(route, self.continuations)) > 0
        }
        # Routes whose chain holds a pool or a backend that shares hardware: only
        # their requests take the slower path (a chain of single backends does not).
        self._special = self.routes.pooled | self.routes.shared
        self.waiting: WaitingRoom | None = None
        self._waitable: frozenset[str] = frozenset()  # the routes that wait in it
        if waiting_room:
            self.waiting, self._waitable = self._waiting_room(
                priority_bands, max_waiting, waiting_key_share
            )
        self._priority = priority_header.lower().encode() if priority_header else None

    def _picker(
        self,
        app: ASGIApp,
        store: Any,
        pick: PickWeights | None,
        pick_policy: PolicyOption | None,
        status_board: StatusBoard | None,
    ) -> tuple[StatusBoard | None, Picker]:
        """The status board (the one given, else that of the watchdog this Failover wraps,
        found once, here) and the Picker of a pool's replicas, with its policy."""
        if pick is not None and not isinstance(pick, PickWeights):
            raise ValueError(f"pick must be a tierchain.picker.PickWeights, got {pick!r}")
        if status_board is not None and not isinstance(status_board, StatusBoard):
            raise ValueError(
                f"status_board must be a tierchain.status.StatusBoard, got {status_board!r}"
            )
        board = status_board if status_board is not None else board_within(app)
        weights = pick or PickWeights()
        picker = Picker(
            weights,
            admission=self.admission,
            store=store,
            board=board,
            policy=resolve_policy(pick_policy, weights),
        )
        return board, picker

    def _waiting_room(
        self, bands: Sequence[str], max_waiting: int, key_share: float
    ) -> tuple[WaitingRoom, frozenset[str]]:
        """The waiting room, and the routes that wait in it: those whose every backend can
        say it is full."""
        room = WaitingRoom(
            bands=bands,
            max_wait=self.max_wait,
            poll=_WAIT_POLL,
            max_waiting=max_waiting,
            key_share=key_share,
        )
        waitable = frozenset(
            r
            for r, chain in self.routes.items()
            if all(b.max_in_flight is not None or b.status_url is not None for b in chain)
        )
        return room, waitable

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind != "http":
            if kind == "lifespan":
                return await self.app(scope, receive, self._lifespan_send(send))
            return await self.app(scope, receive, send)
        refused = self._head.problem(scope)
        if refused is not None:
            return await refuse_request(scope, send, *refused)
        try:
            target = request_target(scope)
        except BadTarget as exc:
            return await refuse(scope, send, exc)
        if scope["method"] != "POST" or not target.path.startswith(self.paths):
            scope[UNROUTED_KEY] = True
            return await self.app(scope, receive, send)
        req = TierRequest.of(scope)
        watch = req.body_watch  # (an outer layer that only watches the body: read past it)
        if watch is not None and watch.inward_receive is not receive:
            watch = None
        elif watch is not None:
            receive = watch.outer_receive
        body = await read_or_refuse(scope, receive, send, self.max_body, self.body_timeout)
        if body is None:
            return  # answered 413 or 408, or the caller left
        req.body = body
        if watch is not None:
            watch.body_read(body)
        req.send_timeout = self.send_timeout
        shape: Shape | None = None
        if len(body) > _SHAPED:  # (shorter, it cannot hold too many values)
            shaped = await shape_of(req, body, read_top=self.resolve is None)
            if isinstance(shaped, Refusal):
                return await refuse_route(send, shaped, target.path)
            shape = shaped
        route = route_of(self.resolve, self._chains, self._known, scope, req, body, shape)
        if isinstance(route, Refusal):
            return await refuse_route(send, route, target.path)
        # The request's route, its chain (reordered, pools gathered) and its wire format.
        chain = self._chains[route]
        for reorder in req.reorderers:
            chain = await reordered(route, chain, reorder)
        plan = self._place(scope, req, route, chain, target.path)
        # The waiting room, then the chain attempt by attempt, then the final answer; the
        # caller watched for leaving and the request's span around it all.
        span = _request_span(req, route)
        guard = DisconnectGuard(receive)
        guard.enter(req.young)  # (as ``async with guard``, without its two coroutines)
        req.interruption = Interruption.beside(guard.cut)  # the same task, the same baseline
        req.guard = guard
        try:
            if self._waitable and route in self._waitable:
                assert self.waiting is not None
                waited = await wait_for_room(
                    self.waiting, self._priority, self.picker, scope, req, route
                )
                if waited is not None:
                    guard.done = True
                    return await turned_away(send, req, waited)
            if await self._chain(req, guard, send, scope, route, plan):
                if span is not INVALID_SPAN:
                    span.set_attribute(ATTR_OUTCOME, "ok")
                return
            guard.done = True
            await self._unanswered(req, send, span)
        except asyncio.CancelledError:
            guard.close()
            if not guard.caused_cancellation():
                raise  # not the caller leaving: a budget, a shutdown
        finally:
            guard.close()
            req.guard = None  # (it holds the receive of the layers outside: no cycle left)
            if span is not INVALID_SPAN:
                span.end()

    def _place(
        self, scope: Scope, req: TierRequest, route: str, chain: tuple[Backend, ...], path: bytes
    ) -> PoolPlan | None:
        """The request's route, its chain (pools gathered) and its wire format set on it;
        its pool plan when the chain holds a pool or shared hardware (else None)."""
        req.route = route
        plan: PoolPlan | None = None
        if self._special and route in self._special:  # (a pool or shared hardware)
            chain = gathered(chain)
            plan = PoolPlan(req, self.picker, (caller_name(scope) or "").encode())
        req.chain = chain
        req.in_chain = True
        req.wire = self._formats.get(route) or recognise(path)
        return plan

    async def _chain(
        self,
        req: TierRequest,
        guard: DisconnectGuard,
        send: Send,
        scope: Scope,
        route: str,
        plan: PoolPlan | None,
    ) -> bool:
        """The chain, attempt by attempt: True once one answered, False when none is left."""
        copies = ScopeCopy(scope)  # the scope itself for the first attempt, copies after
        chain = req.chain
        # (deadline None, started now: positional, as a class called with a keyword builds a
        # dict of it and unpacks it again)
        attempt: Attempt | None = Attempt(1, len(chain), chain[0], route, None, clock.now())
        if plan is not None and chain[0].pool is not None:  # the pool's best replica
            attempt = await plan.picked(req, Attempt(1, len(chain), chain[0], route))
        tries: Tries | None = None  # made at the first attempt that did not answer
        while attempt is not None:
            answered, attempt, fault = await self._attempt(req, guard, send, attempt, copies, plan)
            if answered:
                return True
            if tries is None:
                tries = Tries()
            attempt = await self._after(req, plan, attempt, fault, tries)
        return False

    async def _unanswered(self, req: TierRequest, send: Send, span: Span) -> None:
        """No attempt answered: the caller gets a continuation's break (no tier was left to
        finish it), else every tier's failure (503, 429 or 502)."""
        if req.continuation is not None:
            return await gave_up(req, send)
        if span is not INVALID_SPAN:
            span.set_attribute(ATTR_OUTCOME, "all_failed")
            span.set_status(Status(StatusCode.ERROR, "every backend failed"))
        await all_failed(req, send, len(req.chain))

    async def _attempt(
        self,
        req: TierRequest,
        guard: DisconnectGuard,
        send: Send,
        attempt: Attempt,
        copies: ScopeCopy,
        plan: PoolPlan | None,
    ) -> tuple[bool, Attempt, Fault | None]:
        """One attempt, one call of the inner app: whether the caller has its answer, the
        attempt the chain goes on after (a hedge's, once one ran) and its fault."""
        responder = self._begin(req, guard, send, attempt)
        recorded = len(req.attempts)
        if plan is not None and attempt.backend.pool is not None:
            self.picker.started(req.route or "", attempt.backend)
        race: Race | None = None
        try:
            if self.hedging is not None:  # [hedge] a timer for this attempt
                race = self.hedging.arm(self, responder, copies)
            error = await call_inner(self, req, responder, guard, copies)
            if race is None:
                if error is None and responder.committed and type(responder) is Responder:
                    # The usual end, a whole answer committed: what conclude() would do,
                    # without its coroutine.
                    record(req, attempt, responder.outcome)
                    return True, attempt, None
                return await responder.conclude(error), attempt, responder.fault
            # [hedge] settle the race: the chain goes on after its last attempt
            answered, attempt = await race.conclude(responder, error)
            return answered, attempt, responder.fault
        except BaseException:
            # Cancelled from outside: the caller left, or a layer such as Budget ended
            # the request and said why in req.cancel_reason.
            self._cancelled(req, attempt, responder, recorded, race)
            raise
        finally:
            # The exception's traceback holds call_inner's frame: let go of it, or the
            # two would wait for the garbage collector together.
            error = None
            if race is None and plan is None:  # (no hedge, no pool: the usual)
                lease = responder.end()
                if lease is not None:
                    await self._give_back(lease)
            else:
                await self._ended(req, attempt, responder, recorded, plan, race)

    def _cancelled(
        self,
        req: TierRequest,
        attempt: Attempt,
        responder: Responder,
        recorded: int,
        race: Race | None,
    ) -> None:
        """The attempt was cancelled from outside: record it, unless it already is."""
        if race is None:
            unrecorded = len(req.attempts) == recorded
        else:  # [hedge] the hedge's records are in the same trail
            unrecorded = race.first_unrecorded(recorded)
        if unrecorded:
            responder.outcome = req.cancel_reason or "cancelled"
            record(req, attempt, responder.outcome)

    async def _ended(
        self,
        req: TierRequest,
        attempt: Attempt,
        responder: Responder,
        recorded: int,
        plan: PoolPlan | None,
        race: Race | None,
    ) -> None:
        """The attempt is over: its hedge stopped, its span ended, the picker told, its
        in-flight lease given back (and the first in the waiting room told)."""
        if race is not None:  # [hedge] the hedge's task, cancelled and awaited
            await race.close()
        lease = responder.end()
        if plan is not None and attempt.backend.pool is not None:
            first = responder.observer.first_data_at
            await plan.ended(req, attempt, responder.outcome, first, recorded)
        if lease is not None:
            await self._give_back(lease)

    async def _give_back(self, lease: Any) -> None:
        """An attempt's in-flight lease given back (and the first in the waiting room told)."""
        await self.admission.leave(lease)
        if self.waiting is not None:
            self.waiting.notify()  # a lease freed: the first in line looks

    async def _after(
        self,
        req: TierRequest,
        plan: PoolPlan | None,
        attempt: Attempt,
        fault: Fault | None,
        tries: Tries,
    ) -> Attempt | None:
        """The attempt after one that did not answer: the same backend again (``retries``),
        the next replica or tier, or None."""
        if fault is not None and fault.again:
            pause = retry_pause(req, attempt, fault, tries, self.retries, self.max_retry_wait)
            if pause is not None and not (plan is not None and sibling_left(req, attempt)):
                return await again(req, attempt, fault, pause, tries)
        if plan is None:
            return next_attempt(req, attempt)
        return await plan.next_after(req, attempt, fault)

    def _lifespan_send(self, send: Send) -> Send:
        async def lifespan_send(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await self.admission.aclose()
            await send(message)

        return lifespan_send

    def _begin(
        self, req: TierRequest, guard: DisconnectGuard, send: Send, attempt: Attempt
    ) -> Responder:
        """Set up one attempt: its deadline, its responder (its ``send``, with its observer
        and span: a :class:`Continuing` for a continuation), its state event."""
        if req.deadline is not None:
            attempt.deadline = req.deadline
            if attempt.deadline <= clock.now():
                raise BudgetExhausted("the request's budget was spent before the next attempt")
        backend = attempt.backend
        req.attempt = attempt
        req.attempt_error = None
        req.aborted = False
        # (Its observer, on the request, before the state event that listeners read it with.)
        kind = Responder if req.continuation is None else Continuing
        responder = kind(self, req, attempt, send, guard)
        if backend.pool is None and not attempt.retry:
            req.emit(
                "attempt", n=attempt.n, of=attempt.of, backend=backend.name, regime=backend.regime
            )
        else:
            fields: dict[str, Any] = {"pool": backend.pool} if backend.pool is not None else {}
            if attempt.retry:
                fields["retry"] = attempt.retry
            req.emit(
                "attempt",
                n=attempt.n,
                of=attempt.of,
                backend=backend.name,
                regime=backend.regime,
                **fields,
            )
        return responder
