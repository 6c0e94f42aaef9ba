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
with the partial answer in it (:mod:`tierchain.continuation`), and its events are
spliced into the caller's stream in the first tier's envelope (``_continue``,
``_Continuing``); if it cannot finish the answer, the caller gets the original
break. Otherwise a later failure (``stream_broken``, ``truncated``, ``stalled``,
``malformed_stream``) drops any partial event and ends the stream with an error
in the request's wire format (:func:`tierchain.wire.error_bytes`: an OpenAI
error event, an Anthropic ``event: error``, a Responses ``error`` event, an
NDJSON ``{"error": ...}`` line), and aborts any other body (the server then closes
the connection, so the caller sees an incomplete response rather than a
silently short one). Either way it counts against the backend.

When every tier refused with 429 or 503 the caller gets 429 (503 if any tier
said 503, or a breaker was open for another reason than the backend's own
``Retry-After``) with the soonest ``Retry-After`` any tier gave and each
tier's message; otherwise 502 listing every attempt.

When the caller disconnects, the running attempt is cancelled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, NamedTuple

from opentelemetry.trace import INVALID_SPAN, Span, Status, StatusCode, use_span

from . import _json
from ._body import DEFAULT_BODY_TIMEOUT, read_or_refuse, timeout_option
from ._checks import count, duration
from ._disconnect import DisconnectGuard, Replay
from ._head import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS, HeadLimits, refuse_request
from ._responses import (
    caller_cut,
    error_detail,
    header,
    retry_after,
    send_final,
    send_json_error,
)
from ._runtime import clock, deadlines
from ._runtime.deadlines import EARLY
from ._runtime.interrupt import Interruption
from ._target import BadTarget, refuse, request_target
from ._types import ASGIApp, Headers, Message, Receive, Scope, Send
from .admission import Admission
from .backend import Backend, Routes
from .continuation import Seam, prefill_for, seam
from .errors import (
    AttemptError,
    BackendBusy,
    BackendSaturated,
    BackendSkipped,
    BackendUnavailable,
    BudgetExhausted,
    CallerStalled,
    ResolveError,
    RetryableStatus,
    StreamError,
)
from .hedging import Hedging, Race
from .keys import caller_name, may_jump
from .observer import Observer, nothing_sent
from .picker import Picker, PickWeights, Prefix, prefix_keys
from .request import (
    DEFAULT_SEND_TIMEOUT,
    TRAIL_HEADER,
    UNROUTED_KEY,
    Attempt,
    AttemptRecord,
    ReplicaRecord,
    TierRequest,
    format_trail,
)
from .status import StatusBoard, board_within
from .telemetry import (
    ATTEMPTS,
    ATTR_AFTER_CHARS,
    ATTR_ATTEMPT_N,
    ATTR_ATTEMPT_OF,
    ATTR_BACKEND,
    ATTR_CONTINUES,
    ATTR_OUTCOME,
    ATTR_POOL,
    ATTR_REGIME,
    ATTR_RETRY,
    ATTR_ROUTE,
    BACKEND_BUSY,
    CONTINUATIONS,
    SAME_TIER_RETRIES,
    TIME_TO_FIRST_CHUNK,
    labelled,
    log_event,
    start_span,
    tracing_enabled,
)
from .waiting import WaitingRoom, WaitRefused
from .wire import context_exceeded, error_format, recognise

__all__ = ["DEFAULT_RETRY_STATUSES", "DEFAULT_SEND_TIMEOUT", "Failover", "ResolveError"]

DEFAULT_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504, 529})
"""Statuses that advance the chain before commit (529: Anthropic's "overloaded")."""
_NOT_FOUND = 404  # a routed path the backend does not serve: its fault, the chain advances
BACKEND_HEADER = b"x-tierchain-backend"
_OWN_HEADERS = b"x-tierchain-"  # the gateway's own response headers' prefix
_COMMENT_LIMIT = 64 * 1024  # comment bytes held before the first data event
_REFUSAL_LIMIT = 64 * 1024  # bytes of a retryable answer's body kept for its message
_REFUSED = frozenset({429, 503})
_REFUSALS = frozenset({"http_429", "http_503"})
# Saturations whose reason the backend_saturated state line carries (the words this
# layer's callers may not know from the plain stopwatch).
_SHOWN_WHY = frozenset({"reserve", "too_slow", "incomplete"})
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
_AGAIN = ("transient:", "wait:")
_JITTER = 0.25  # a second try waits up to this long more, at random (no herd on one backend)
# The detail of a skip whose breaker a backend's Retry-After opened: the caller hears 429.
_SAID_WHEN_SKIP = "cooling down for the backend's Retry-After"
_WAIT_POLL = 0.25  # how often the first in the waiting room looks again unwoken
_CONTINUE_MIN_LEFT = 1.0  # budget seconds below which a broken stream is not continued
_TOOLS = frozenset({"tool_calls", "tool_use", "function_call", "server_tool_use"})


Resolver = Callable[[Scope, bytes], str]
# The key tuples of the scopes seen (one per shape: server, framework, mounts).
_SCOPE_SHAPES: dict[tuple[str, ...], tuple[str, ...]] = {}
_SCOPE_SHAPES_MAX = 256
# The C scanner, when the json module has it.
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _scan_object(body: bytes) -> dict[str, Any] | None:
    """The usual body (a UTF-8 JSON object) read by the scanner alone, else None.

    The same parser as ``json.loads`` without its encoding detection and its
    Python-level wrappers; anything unusual (or wrong) is left to the loader
    (:mod:`tierchain._json`), which bounds the depth and gives the error message.
    """
    if body[:1] != b"{" or not _json.depth_ok(body):
        return None  # the loader checks the depth of a text with many brackets
    try:
        text = body.decode()
        data, end = _scan(text, 0)
    except (StopIteration, UnicodeDecodeError, ValueError):
        return None
    if end != len(text) and text[end:].strip(" \t\n\r"):
        return None  # something after the object: the loader says what
    return data if isinstance(data, dict) else None


class _Refusal(NamedTuple):
    """A request Failover cannot route: the arguments of its JSON error answer."""

    status: int
    message: str
    type: str
    code: str


def _json_body(body: bytes) -> dict[str, Any]:
    data = _scan_object(body)
    if data is not None:
        return data
    try:
        data = _json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ResolveError(f"the request body is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ResolveError("the request body must be a JSON object with a string 'model'")
    return data


class Failover:
    """Own the chain: one call of the inner app per attempt, until one answers.

    ``routes`` maps a logical model to its chain (a :class:`Routes` or a plain
    mapping). ``resolve(scope, body) -> route`` replaces the default, which
    reads the OpenAI-compatible JSON body's ``model``. ``retry_statuses`` are
    the statuses that advance the chain when they arrive before anything was
    sent. ``hold_limit`` is how large a non-streaming answer may be and still be
    held until it is whole (larger ones stream on, and can no longer fail over).
    Every response carries ``x-tierchain-attempts``, the attempt trail.

    ``store`` counts the attempts in flight at each backend that has a
    ``max_in_flight`` (share one :class:`~tierchain.RedisStore` between
    replicas to count across them; None counts in this process), with leases
    that run out after ``lease`` seconds unless renewed. A backend that is full
    is skipped at once as ``backend_busy`` (never the chain's last tier).

    Only ``POST`` requests whose path starts with one of ``paths`` are routed;
    anything else (``GET /v1/models``, a health check, an admin page) passes
    straight through to the inner app with no attempt. Every HTTP request's
    target is checked first: one that could steer the upstream URL (not a plain
    path, a ``..`` segment, a backslash, a NUL, also percent-encoded) is answered
    400 before any routing, and ``paths`` is matched against the normalised path
    that the Forwarder sends upstream.

    Before that, the caller's head: more than ``max_headers`` header fields or
    ``max_header_bytes`` of them is answered 431, both ``Content-Length`` and
    ``Transfer-Encoding`` 400 (see :mod:`tierchain._head`); and a routed
    request's body must arrive whole within ``body_timeout`` seconds (408
    otherwise; None: no deadline).

    Once the response has started, a caller that stops reading is the caller's
    problem: a send to it that is out for longer than ``send_timeout`` seconds
    (None: no bound) cuts the request with outcome ``caller_stalled``. No error
    event is written (it would wait on the same caller), the server drops the
    connection, the attempt's in-flight lease is given back at once, and no
    breaker counts it against the backend. The final error event after a
    backend failed mid-stream is bounded the same way, and sent after the lease
    is given back.

    A :class:`~tierchain.Pool` in a chain: each time the chain reaches it, its
    replicas are ordered by their live state with the weights ``pick`` (a
    :class:`~tierchain.picker.PickWeights`; see :mod:`tierchain.picker`), and a
    replica that fails before commit is followed by the next one, then by the
    next tier. After a backend that ``shares`` hardware was saturated or busy,
    the backends of the same group are passed over (outcome ``busy``, reason
    ``shares``).

    ``retries``: how many times one request may send an attempt again to the
    same backend after a transient fault before commit (a 500, 502, 503 or
    529 with no ``Retry-After``, or a reset before the request was written
    whole (``not_sent``), after a random pause of up to 0.25 s; a 429, 503 or
    529 whose ``Retry-After`` is at most ``max_retry_wait`` seconds and fits
    the budget's room, waited out once per request; never a 400, never a reset
    after the request went out whole: the backend may have read it; a
    backend's own ``retries`` overrides it); never for a saturation, never
    past the reserve kept for the later tiers, never while another replica of
    the same pool is left to try; the last tier too. 0: never.
    ``max_retry_wait``: the longest ``Retry-After`` waited out so (0: none).

    ``waiting_room``: on a route whose every backend has a ``max_in_flight``
    or a ``status_url``, a request that finds every one of them full waits at
    the gateway (see :mod:`tierchain.waiting`), at most ``max_wait`` seconds,
    first come first served within the band its ``priority_header`` names (one
    of ``priority_bands``, highest first; None: one band for all). Behind
    :class:`~tierchain.keys.CallerKeys`, only a key with ``priority`` may name a
    band above the middle one. At most ``max_waiting`` requests wait (503 with
    ``Retry-After`` past it), one caller key at most ``waiting_key_share`` of
    them (429), and a request still waiting after ``max_wait`` gets 503.

    ``continuations``: how many times per request a committed event stream (or
    NDJSON stream) that broke or stalled may be finished on a later tier,
    spliced into the caller's stream (see :mod:`tierchain.continuation`); 0:
    never. A route's own ``Routes(..., continuations=...)`` wins. A stream with
    a tool call in flight is never continued.

    ``hedge_after``: seconds after which an attempt at a tier that may be hedged
    (``Backend(hedge=True)``, or a local backend when ``hedge`` is None), with no
    first data event and no firm verdict from the watchdog, is joined by an attempt at
    the next tier; the first to produce data wins and the other is cancelled, never
    counted as a failure (see :mod:`tierchain.hedging`). None or 0: never (the default).

    ``status_board``: the :class:`~tierchain.status.StatusBoard` whose polled
    statuses order a pool's replicas and tell the waiting room a backend is
    full (None: the board of the SaturationWatchdog inside ``app``, if any).
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
        self.admission = Admission(store, lease=lease)
        if pick is not None and not isinstance(pick, PickWeights):
            raise ValueError(f"pick must be a tierchain.picker.PickWeights, got {pick!r}")
        if status_board is not None and not isinstance(status_board, StatusBoard):
            raise ValueError(
                f"status_board must be a tierchain.status.StatusBoard, got {status_board!r}"
            )
        # The board of the watchdog this Failover wraps (found once, here), or the one given.
        self.status_board = status_board if status_board is not None else board_within(app)
        self.picker = Picker(
            pick or PickWeights(), admission=self.admission, store=store, board=self.status_board
        )
        self.retries = count("retries", retries, minimum=0)
        self.max_retry_wait = duration("max_retry_wait", max_retry_wait, allow_zero=True)
        self.max_wait = duration("max_wait", max_wait)
        self.continuations = count("continuations", continuations, minimum=0)
        # The routes whose committed streams may be continued on a later tier, and how
        # often per request (a route's own ``continuations`` in Routes wins).
        self._continuable = {
            route: n
            for route in self.routes
            if len(self.routes[route]) > 1
            and (n := self.routes.continuations(route, self.continuations)) > 0
        }
        # Routes whose chain holds a pool or a backend that shares hardware: only
        # their requests take the slower path (a chain of single backends does not).
        self._special = self.routes.pooled | self.routes.shared
        self.waiting = (
            WaitingRoom(
                bands=priority_bands,
                max_wait=self.max_wait,
                poll=_WAIT_POLL,
                max_waiting=max_waiting,
                key_share=waiting_key_share,
            )
            if waiting_room
            else None
        )
        self._priority = priority_header.lower().encode() if priority_header else None
        # The routes whose every backend can say it is full: the only ones that wait.
        self._waitable = (
            frozenset(
                r
                for r, chain in self.routes.items()
                if all(b.max_in_flight is not None or b.status_url is not None for b in chain)
            )
            if waiting_room
            else frozenset()
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, self._lifespan_send(send))
        if scope["type"] != "http":
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
        body = await read_or_refuse(scope, receive, send, self.max_body, self.body_timeout)
        if body is None:
            return  # answered 413 or 408, or the caller left
        req.body = body
        req.send_timeout = self.send_timeout
        route = self._route(scope, req, body)
        if isinstance(route, _Refusal):
            return await send_json_error(send, *route, wire=error_format(target.path))
        chain = self.routes[route]
        for reorder in req.reorderers:
            chain = await self._reordered(route, chain, reorder)
        req.route = route
        plan: _Plan | None = None
        if self._special and route in self._special:  # (a pool or shared hardware)
            chain = _gathered(chain)
            plan = _Plan(req, (caller_name(scope) or "").encode())
        req.chain = chain
        req.in_chain = True
        req.wire = self.routes.wire_format(route) or recognise(target.path)

        span = start_span("tierchain.request", {ATTR_ROUTE: route})
        guard = DisconnectGuard(receive)
        guard.enter()  # (as ``async with guard``, without its two coroutines)
        req.interruption = Interruption.beside(guard.cut)  # the same task, the same baseline
        try:
            if self._waitable and route in self._waitable:
                turned_away = await self._wait(scope, req, route)
                if turned_away is not None:
                    guard.done = True
                    return await send_json_error(
                        send,
                        turned_away.status,
                        turned_away.message,
                        "rate_limit_error" if turned_away.status == 429 else "server_error",
                        turned_away.code,
                        headers=[(b"retry-after", str(turned_away.retry_after).encode())],
                        wire=req.wire,
                    )
            # The chain, attempt by attempt, in this frame: a waiting stream holds one
            # frame of ours.
            # The scope as it came, for the attempts after the first (routers such as
            # Starlette's Mount and Litestar's rewrite it as they dispatch, and a replay
            # must start from the original): its values, with its keys kept once for
            # every request of the same shape. The first attempt gets the scope itself.
            keys = tuple(scope)
            if len(_SCOPE_SHAPES) < _SCOPE_SHAPES_MAX:
                keys = _SCOPE_SHAPES.setdefault(keys, keys)
            pristine = tuple(scope.values())
            first = True
            attempt: Attempt | None = Attempt(1, len(chain), chain[0], route, started=clock.now())
            if plan is not None and chain[0].pool is not None:
                attempt = await self._picked(req, plan, Attempt(1, len(chain), chain[0], route))
            retried = 0
            waited = False  # a Retry-After waited out (once per request)
            while attempt is not None:
                responder = self._begin(req, guard, send, attempt)
                recorded = len(req.attempts)
                race: Race | None = None  # [hedge]
                if plan is not None and attempt.backend.pool is not None:
                    self.picker.started(route, attempt.backend)
                try:
                    error: BaseException | None = None
                    try:
                        if attempt.backend.max_in_flight is not None:
                            responder.lease = await self.admission.enter(
                                attempt.backend, last=attempt.is_last
                            )
                            if self.waiting is not None and self.waiting.waiting(route):
                                self.waiting.notify()  # the room this took is counted now
                        if first:
                            first = False
                            attempt_scope = scope
                        else:
                            attempt_scope = dict(zip(keys, pristine, strict=True))
                        if self.hedging is not None:  # [hedge] a timer for this attempt
                            race = self.hedging.arm(
                                self, req, attempt, responder, guard, send,
                                lambda: dict(zip(keys, pristine, strict=True)),
                            )  # fmt: skip
                        # The attempt's span is current inside, so that the Forwarder (or
                        # the host's own client instrumentation) sends its trace context
                        # upstream.
                        inner = self.app(
                            attempt_scope, Replay(req.body or b"", guard), responder.send
                        )
                        if responder.span is INVALID_SPAN:
                            await inner
                        else:
                            with _current(responder.span):
                                await inner
                    except asyncio.CancelledError:
                        if not _own_abort(req):
                            raise
                        error = req.attempt_error
                    except Exception as exc:
                        error = exc
                    else:
                        if req.aborted:
                            _own_abort(req)  # the app swallowed our cancellation and returned
                        error = req.attempt_error or responder.failure()
                    if race is None:
                        answered = await responder.conclude(error)
                    else:  # [hedge] settle the race: the chain goes on after its last attempt
                        answered, attempt = await race.conclude(responder, error)
                    if answered:
                        if span is not INVALID_SPAN:
                            span.set_attribute(ATTR_OUTCOME, "ok")
                        return
                except BaseException:
                    # Cancelled from outside: the caller left, or a layer such as Budget
                    # ended the request and said why in req.cancel_reason.
                    if race is None:
                        unrecorded = len(req.attempts) == recorded
                    else:  # [hedge] the hedge's records are in the same trail
                        unrecorded = race.first_unrecorded(recorded)
                    if unrecorded:
                        responder.outcome = req.cancel_reason or "cancelled"
                        self._record(req, attempt, responder.outcome)
                    raise
                finally:
                    # The exception's traceback holds this frame: let go of it, or the two
                    # would wait for the garbage collector together.
                    error = None
                    if race is not None:  # [hedge] the hedge's task, cancelled and awaited
                        await race.close()
                    lease = responder.end()
                    if plan is not None and attempt.backend.pool is not None:
                        await self._picked_ended(req, plan, attempt, responder, recorded)
                    if lease is not None:
                        await self.admission.leave(lease)
                        if self.waiting is not None:
                            self.waiting.notify()  # a lease freed: the first in line looks
                fault = responder.fault
                if fault is not None and fault.startswith(_AGAIN):
                    pause = self._retry_pause(req, attempt, fault, retried, waited)
                    if pause is not None and not (plan is not None and _sibling_left(req, attempt)):
                        retried += 1
                        why = fault.partition(":")[2]
                        if fault.startswith("wait:"):
                            waited = True
                        labelled(SAME_TIER_RETRIES, route, attempt.backend.name, why).inc()
                        await self._pause(req, attempt, pause, why)
                        attempt = Attempt(
                            attempt.n, attempt.of, attempt.backend, route, retry=attempt.retry + 1
                        )
                        continue
                if plan is None:
                    attempt = self._next(req, attempt)
                else:
                    attempt = await self._next_planned(req, plan, attempt, fault)
            if req.continuation is not None:
                # A continuation found no tier to run on: the break is the caller's answer.
                guard.done = True
                await self._gave_up(req, send)
                return
            guard.done = True
            if span is not INVALID_SPAN:
                span.set_attribute(ATTR_OUTCOME, "all_failed")
                span.set_status(Status(StatusCode.ERROR, "every backend failed"))
            await self._all_failed(req, send, len(chain))
        except asyncio.CancelledError:
            guard.close()
            if not guard.caused_cancellation():
                raise  # not the caller leaving: a budget, a shutdown
        finally:
            guard.close()
            if span is not INVALID_SPAN:
                span.end()

    def _lifespan_send(self, send: Send) -> Send:
        async def lifespan_send(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await self.admission.aclose()
            await send(message)

        return lifespan_send

    def _route(self, scope: Scope, req: TierRequest, body: bytes) -> str | _Refusal:
        """The request's route, or why it has none (the caller's 400 or 404)."""
        try:
            if self.resolve is not None:
                route = self.resolve(scope, body)
            else:
                data = _json_body(body)
                model = data.get("model")
                if not isinstance(model, str):
                    raise ResolveError("the request body has no string 'model' to route on")
                route = model
                if req.streaming is None:
                    req.streaming = data.get("stream") is True
        except ResolveError as exc:
            return _Refusal(400, str(exc), "invalid_request_error", "invalid_body")
        if route not in self.routes:
            shown = route if len(route) <= 200 else route[:200] + "..."
            return _Refusal(
                404,
                f"no route for model {shown!r}; known routes: {self._known}",
                "invalid_request_error",
                "model_not_found",
            )
        return route

    async def _reordered(
        self, route: str, chain: tuple[Backend, ...], reorder: Any
    ) -> tuple[Backend, ...]:
        try:
            proposed = tuple(await reorder(route, chain))
        except Exception as exc:  # a hint must never fail a request
            log_event("request.reorder_failed", error=repr(exc), route=route)
            return chain
        if len(proposed) != len(chain) or set(proposed) != set(chain):
            log_event("request.reorder_refused", route=route, reason="not a permutation")
            return chain
        return proposed

    def _next(self, req: TierRequest, attempt: Attempt) -> Attempt | None:
        """The attempt after ``attempt``: the next tier, then (when every tier was
        skipped and a Breaker asked for it) one forced try of the soonest; else None."""
        chain = req.chain
        of = len(chain)
        if attempt.force:
            return None
        if attempt.n < of:
            return Attempt(attempt.n + 1, of, chain[attempt.n], req.route)
        skipped = _skipped(req)
        if len(skipped) == of and req.try_soonest:
            name = min(skipped, key=lambda b: skipped[b] or 0.0)
            soonest = next(b for b in chain if b.name == name)
            return Attempt(of, of, soonest, req.route, force=True)
        return None

    def _retry_pause(
        self, req: TierRequest, attempt: Attempt, fault: str, retried: int, waited: bool
    ) -> float | None:
        """How long to pause before trying ``attempt``'s backend again, or None: no
        second try (none left, no room in the budget, a Retry-After too far off)."""
        backend = attempt.backend
        limit = self.retries if backend.retries is None else backend.retries
        if retried >= limit or not _may_retry(req, attempt):
            return None
        pause = _JITTER * random.random()
        if fault.startswith("wait:"):
            after = req.attempts[-1].retry_after if req.attempts else None
            if waited or after is None or after > self.max_retry_wait:
                return None
            pause += after
        left = req.remaining()
        if left is not None and pause >= left - attempt.reserve:
            return None  # no room: the later tiers' time is not ours to wait away
        return pause

    async def _pause(self, req: TierRequest, attempt: Attempt, pause: float, why: str) -> None:
        """Say so, and wait ``pause`` seconds before the same backend is tried again."""
        backend = attempt.backend
        req.emit("retrying", **_named(backend), after_s=round(pause, 1), reason=why)
        log_event(
            "dispatch.same_tier_retry",
            route=attempt.route,
            backend=backend.name,
            reason=why,
            after_s=round(pause, 3),
        )
        await asyncio.sleep(pause)

    async def _wait(self, scope: Scope, req: TierRequest, route: str) -> WaitRefused | None:
        """Wait in the waiting room while every backend of the chain is full (None), or
        the reason the room turns the request away."""
        room = self.waiting
        assert room is not None
        band = room.default_band
        key = caller_name(scope)
        if self._priority is not None:
            band = room.band(header(scope["headers"], self._priority))
            if key is not None and not may_jump(scope):
                band = max(band, room.default_band)  # a key may lower itself, not rise
        chain = req.chain

        async def full() -> bool:
            return await self.picker.all_full(chain)

        try:
            await room.wait(req, route, full, band, key)
        except WaitRefused as refused:
            return refused
        return None

    async def _next_planned(
        self, req: TierRequest, plan: _Plan, attempt: Attempt, fault: str | None
    ) -> Attempt | None:
        """The next attempt of a chain with a pool or shared hardware: the next replica
        picked by live state, past every backend whose hardware is known taken."""
        if fault is not None and fault.startswith("holds:"):
            plan.held.add(fault[6:])
        nxt = self._next(req, attempt)
        while nxt is not None and not nxt.force:
            if nxt.backend.pool is not None:
                nxt = await self._picked(req, plan, nxt)
            shares = nxt.backend.shares
            if shares is None or shares not in plan.held:
                break
            self._record(req, nxt, "busy")
            labelled(BACKEND_BUSY, req.route or "", nxt.backend.name, "shares").inc()
            req.emit(
                "backend_busy",
                **_named(nxt.backend),
                reason="shares",
                shares=shares,
                failing_over=not nxt.is_last,
            )
            nxt = self._next(req, nxt)
        return nxt

    async def _picked(self, req: TierRequest, plan: _Plan, attempt: Attempt) -> Attempt:
        """``attempt`` at the best replica left of its pool (the chain reordered to say so)."""
        chain = req.chain
        i = attempt.n - 1
        pool = chain[i].pool
        j = i + 1
        while j < len(chain) and chain[j].pool == pool:
            j += 1
        run = chain[i:j]
        if len(run) < 2:
            return attempt
        entering = i == 0 or chain[i - 1].pool != pool
        if plan.prefix is None:
            plan.prefix = prefix_keys(req.body, plan.salt)
        route = req.route or ""
        if entering and run[0].name in plan.preferred:
            # A preferred or pinned replica leads; the rest are ordered after it.
            order = [run[0], *await self.picker.order(route, run[1:], req.body, plan.prefix)]
        else:
            order = await self.picker.order(route, run, req.body, plan.prefix)
        req.chain = (*chain[:i], *order, *chain[j:])
        return Attempt(attempt.n, attempt.of, order[0], attempt.route, force=attempt.force)

    async def _picked_ended(
        self,
        req: TierRequest,
        plan: _Plan,
        attempt: Attempt,
        responder: _Responder,
        recorded: int,
    ) -> None:
        """Tell the picker how an attempt at a replica ended (and, when it answered,
        that the replica now holds the request's prompt prefix)."""
        record = req.attempts[recorded] if len(req.attempts) > recorded else None
        outcome = record.outcome if record is not None else responder.outcome
        observer = responder.observer
        first = observer.first_data_at
        self.picker.ended(
            attempt.backend,
            outcome,
            body=req.body,
            first_data_s=None if first is None else first - attempt.started,
            retry_in=record.retry_after if record is not None else None,
        )
        if outcome == "ok" and plan.prefix is not None:
            await self.picker.remember(req.route or "", attempt.backend, plan.prefix)

    async def _all_failed(self, req: TierRequest, send: Send, of: int) -> None:
        """No tier answered: the caller's 503, 429 or 502."""
        skipped = _skipped(req)
        trail = [(TRAIL_HEADER, format_trail(req.attempts))]
        records = req.attempts
        if len(skipped) == of and not all(r.detail == _SAID_WHEN_SKIP for r in records):
            soonest_s = min((s for s in skipped.values() if s is not None), default=1.0)
            retry = max(1, math.ceil(soonest_s))
            await send_json_error(
                send,
                503,
                f"every backend for route {req.route!r} is cooling down; retry in {retry}s",
                "all_backends_open",
                "service_unavailable",
                headers=[*trail, (b"retry-after", str(retry).encode())],
                wire=req.wire,
                backends=[
                    {"backend": b, "state": "open", "retry_in_s": s} for b, s in skipped.items()
                ],
            )
            return
        refused = [r for r in records if r.outcome in _REFUSALS or _cooling(r)]
        if refused and all(
            r.outcome in ("http_429", "http_503", "skipped", "busy") for r in records
        ):
            # Every tier said "not now": that is the caller's answer, not a bad gateway. A
            # tier still cooling down from its own Retry-After says it again: 429 stays 429
            # for the callers after the first.
            status = 429 if all(r.outcome == "http_429" or _cooling(r) for r in records) else 503
            given = [r.retry_after for r in records if r.retry_after is not None]
            retry = max(1, math.ceil(min(given))) if given else 1
            await send_json_error(
                send,
                status,
                f"every backend for route {req.route!r} is "
                + ("rate limited" if status == 429 else "unavailable or busy")
                + f"; retry in {retry}s",
                "rate_limit_exceeded" if status == 429 else "all_backends_busy",
                "rate_limited" if status == 429 else "service_unavailable",
                headers=[*trail, (b"retry-after", str(retry).encode())],
                wire=req.wire,
                attempts=[_attempt_json(r) for r in records],
            )
            return
        await send_json_error(
            send,
            502,
            f"all {of} backends for route {req.route!r} failed",
            "all_backends_failed",
            "bad_gateway",
            headers=trail,
            wire=req.wire,
            attempts=[_attempt_json(r) for r in records],
        )

    def _begin(
        self, req: TierRequest, guard: DisconnectGuard, send: Send, attempt: Attempt
    ) -> _Responder:
        """Set up one attempt: its observer, its state event, its span, its ``send``."""
        if req.deadline is not None:
            attempt.deadline = req.deadline
            if attempt.deadline <= clock.now():
                raise BudgetExhausted("the request's budget was spent before the next attempt")
        backend = attempt.backend
        req.attempt = attempt
        req.attempt_error = None
        req.aborted = False
        observer = req.observer = Observer(
            attempt.started, stream_end=backend.stream_end, wire=backend.wire_format or req.wire
        )
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
        if req.continuation is not None:
            return self._continuing(req, attempt, observer, send, guard)
        return _Responder(self, req, attempt, observer, send, guard, _attempt_span(attempt))

    # -- continuation: finish a broken stream on the next tier ----------------------

    def _continue(
        self,
        req: TierRequest,
        attempt: Attempt,
        wire: str | None,
        ndjson: bool,
        sent: list[bytes],
        error: bytes,
    ) -> bool:
        """After a committed stream broke: set up its continuation on the next tier
        (True), or say it cannot be (False: the caller gets ``error``).

        Parses the events the caller has (``sent``) once, here, off the healthy path."""
        route = req.route or ""
        previous = req.continuation
        done = previous.done if previous is not None else 0
        origin = previous.origin if previous is not None else attempt.backend.name
        if (
            done >= self._continuable.get(route, 0)
            or attempt.n >= len(req.chain)
            or req.cancel_reason is not None
            or req.body is None
        ):
            req.continuation = None
            return False
        target = req.chain[attempt.n]
        to = target.pool or target.name  # (a pool's replica is picked when it starts)
        left = req.remaining()
        why = ""
        # At least a second of budget left (or half the reserve the watchdog kept, when
        # that is shorter: a stream it cut at the reserve's point has about the reserve).
        least = _CONTINUE_MIN_LEFT
        if attempt.reserve:
            least = min(least, attempt.reserve / 2)
        if left is not None and left < least:
            why = "no_time"
        elif (target.wire_format or req.wire) != wire:
            why = "unsupported"  # another wire format: the envelope could not be kept
        body = previous.body if previous is not None else req.body
        try:
            found = seam(wire, origin, b"".join(sent), ndjson=ndjson)
        except Exception as exc:  # events of a shape no format rule expects
            found = Seam(origin)
            found.ok, found.why = False, f"unparsed: {exc!r}"
        if not why and not found.ok:
            why = "tool_calls" if found.why in _TOOLS else "unsupported"
        if not why and found.request(body, prefill=False) is None:
            why = "unsupported"  # not a JSON body with messages
        if why:
            req.continuation = None
            labelled(CONTINUATIONS, route, origin, to, why).inc()
            log_event(
                "dispatch.continuation",
                level=30,
                route=route,
                outcome=why,
                detail=found.why or None,
                origin=origin,
                backend=to,
            )
            return False
        req.continuation = _Continuation(found, error, done + 1, origin, sent, body, wire, ndjson)
        req.emit("continuing", **{"from": origin}, backend=to, after_chars=len(found.text))
        log_event(
            "dispatch.continuing",
            route=route,
            after_chars=len(found.text),
            origin=origin,
            backend=to,
        )
        return True

    def _continuing(
        self,
        req: TierRequest,
        attempt: Attempt,
        observer: Observer,
        send: Send,
        guard: DisconnectGuard,
    ) -> _Continuing:
        """The responder of an attempt that finishes a broken answer: its request is the
        original one with the partial answer in it."""
        cont = req.continuation
        assert cont is not None
        backend = attempt.backend
        wire = backend.wire_format or req.wire
        req.body = cont.seam.request(cont.body, prefill=prefill_for(wire, backend.prefill))
        span = _attempt_span(attempt)
        if span is not INVALID_SPAN:
            span.set_attribute(ATTR_CONTINUES, cont.origin)
            span.set_attribute(ATTR_AFTER_CHARS, len(cont.seam.text))
        return _Continuing(self, req, attempt, observer, send, guard, span, cont)

    async def _gave_up(self, req: TierRequest, send: Send) -> None:
        """No tier was left to continue on: end the stream with the original break."""
        cont = req.continuation
        assert cont is not None
        req.continuation = None
        message = {"type": "http.response.body", "body": cont.error, "more_body": False}
        await send_final(send, message, req)

    def _record(
        self,
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
        labelled(ATTEMPTS, attempt.route or "", backend.name, outcome).inc()

    def _failed(
        self, req: TierRequest, attempt: Attempt, exc: BaseException, outcome: str
    ) -> str | None:
        """Record and announce a failed attempt. Returns what the next step must know:
        ``holds:<group>`` when the backend's shared hardware is taken (saturated or
        busy), ``transient:<reason>`` for a fault worth a second try, else None."""
        retry: float | None = None
        detail: str | None = None
        if isinstance(exc, BackendSkipped):
            retry = exc.retry_in
            if exc.why == "retry_after":
                detail = _SAID_WHEN_SKIP
        elif isinstance(exc, RetryableStatus):
            retry, detail = exc.retry_after, exc.detail
        self._record(req, attempt, outcome, retry, detail)
        backend = attempt.backend.name
        named = _named(attempt.backend)
        failing_over = not attempt.is_last
        fault: str | None = None
        if isinstance(exc, BackendBusy):
            why = "max_in_flight" if exc.why == "max_in_flight" else "status"
            labelled(BACKEND_BUSY, attempt.route or "", backend, why).inc()
            fields: dict[str, Any] = dict(named)
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
                **named,
                retry_in_s=None if retry is None else round(retry, 1),
                failing_over=failing_over,
            )
        elif isinstance(exc, BackendSaturated):
            if exc.why in _SHOWN_WHY:
                req.emit("backend_saturated", **named, reason=exc.why, failing_over=failing_over)
            else:
                req.emit("backend_saturated", **named, failing_over=failing_over)
            fault = _holds(attempt.backend)
        else:
            req.emit("backend_failed", **named, reason=outcome, failing_over=failing_over)
            if outcome in _SAID_WHEN and retry is not None:
                fault = "wait:" + outcome  # the backend said when: waited out, if there is room
            elif outcome in _TRANSIENT:
                fault = "transient:" + outcome
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


class _Plan:
    """A request's facts for a chain with a pool or shared hardware."""

    __slots__ = ("held", "preferred", "prefix", "salt")

    def __init__(self, req: TierRequest, salt: bytes = b"") -> None:
        self.held: set[str] = set()  # the shares groups known taken
        self.prefix: Prefix | None = None  # the prompt's prefix hashes, once a pool needs them
        self.salt = salt  # the caller key's name: prefixes never match across keys
        preferred = set()
        if req.pin is not None:
            preferred.add(req.pin)
        if req.preference is not None and req.preference.applied:
            preferred.add(req.preference.requested)
        self.preferred = frozenset(preferred)


def _gathered(chain: tuple[Backend, ...]) -> tuple[Backend, ...]:
    """``chain`` with each pool's replicas side by side, where its first one stands
    (a preference may have moved one replica ahead of the rest)."""
    out: list[Backend] = []
    done: set[str] = set()
    for backend in chain:
        pool = backend.pool
        if pool is None:
            out.append(backend)
        elif pool not in done:
            done.add(pool)
            out.extend(b for b in chain if b.pool == pool)
    return tuple(out)


def _named(backend: Backend) -> dict[str, Any]:
    """A state line's naming fields: the backend, and its pool when it has one."""
    if backend.pool is None:
        return {"backend": backend.name}
    return {"backend": backend.name, "pool": backend.pool}


def _holds(backend: Backend) -> str | None:
    return None if backend.shares is None else "holds:" + backend.shares


def _sibling_left(req: TierRequest, attempt: Attempt) -> bool:
    """True when another replica of the attempt's pool comes next: it is the retry."""
    pool = attempt.backend.pool
    return pool is not None and attempt.n < len(req.chain) and req.chain[attempt.n].pool == pool


def _may_retry(req: TierRequest, attempt: Attempt) -> bool:
    """True when a second try of the same backend keeps the reserve (and the budget)."""
    if req.committed or req.cancel_reason is not None:
        return False
    left = req.remaining()
    return left is None or left > attempt.reserve


def _current(span: Span) -> AbstractContextManager[object]:
    """``span`` made the current span, when it records (else nothing to do)."""
    if not span.is_recording():
        return nullcontext()
    return use_span(span, record_exception=False, set_status_on_exception=False)


def _attempt_span(attempt: Attempt) -> Span:
    if not tracing_enabled():
        return INVALID_SPAN  # no SDK: not even the attributes are built
    backend = attempt.backend
    attrs: dict[str, str | int] = {
        ATTR_ROUTE: attempt.route or "",
        ATTR_BACKEND: backend.name,
        ATTR_ATTEMPT_N: attempt.n,
        ATTR_ATTEMPT_OF: attempt.of,
    }
    if backend.regime:
        attrs[ATTR_REGIME] = backend.regime
    if backend.pool is not None:
        attrs[ATTR_POOL] = backend.pool
    if attempt.retry:
        attrs[ATTR_RETRY] = attempt.retry
    return start_span("tierchain.attempt", attrs)


def _own_abort(req: TierRequest) -> bool:
    """True when the running task's cancellation was the attempt's own abort (now undone)."""
    if not req.aborted:
        return False
    req.aborted = False
    # Only our own cancellation: a pending one (the caller left, the budget) goes on.
    return req.interruption is not None and req.interruption.ours()


def _cooling(record: AttemptRecord) -> bool:
    """True for a skip whose breaker the backend's own Retry-After opened."""
    return record.outcome == "skipped" and record.detail == _SAID_WHEN_SKIP


def _skipped(req: TierRequest) -> dict[str, float | None]:
    """The backends whose breaker skipped them, with when each said to come back."""
    return {r.backend: r.retry_after for r in req.attempts if r.outcome == "skipped"}


def _attempt_json(record: AttemptRecord) -> dict[str, Any]:
    item: dict[str, Any] = {"backend": record.backend, "outcome": record.outcome}
    if record.pool is not None:
        item["pool"] = record.pool
    if record.retry_after is not None:
        item["retry_after_s"] = round(record.retry_after, 1)
    if record.detail is not None:
        item["message"] = record.detail
    return item


class _Responder:
    """One attempt's ``send``: feeds its observer, holds the start until it is worth sending."""

    __slots__ = (
        "_caller_watch",
        "_ended",
        "_failover",
        "_guard",
        "_held",
        "_held_size",
        "_send",
        "_task",
        "attempt",
        "caller_cut",
        "committed",
        "fault",
        "kept",
        "lease",
        "observer",
        "outcome",
        "race",
        "refusal",
        "req",
        "span",
        "start",
    )

    def __init__(
        self,
        failover: Failover,
        req: TierRequest,
        attempt: Attempt,
        observer: Observer,
        send: Send,
        guard: DisconnectGuard,
        span: Span,
    ) -> None:
        self._failover = failover
        self.span = span
        self.lease: Any = None  # an in-flight lease at the backend, while held
        self.req = req
        self.attempt = attempt
        self.observer = observer
        self._send = send
        self._guard = guard
        self.start: Message | None = None
        self.committed = False
        self.outcome = "ok"
        self.fault: str | None = None  # what a failure tells the next step (Failover._failed)
        self.refusal: list[bytes] | None = None  # a retryable answer's body, being kept
        self._held: list[bytes] | None = None  # made when something is held
        self._held_size = 0
        self._caller_watch: deadlines.Deadline | None = None  # send_timeout, from commit
        self._task: asyncio.Task[Any] | None = None  # the request's task, for the cut
        self.caller_cut = False  # the watch cut the caller (its cancellation is ours)
        self._ended = False
        # The committed events, by reference, while a continuation could follow a break
        # (see Failover._continue): parsed only then.
        self.kept: list[bytes] | None = None
        self.race: Race | None = None  # [hedge] the race this attempt is in, if any

    def send(self, message: Message) -> Awaitable[None]:
        """The inner app's send. A committed stream's events go straight on."""
        if self.committed and message["type"] == "http.response.body":
            observer = self.observer
            chunk: bytes = message.get("body", b"")
            more = message.get("more_body", False)
            if observer.sse or observer.ndjson:
                try:
                    out = observer.body(chunk)
                except StreamError as exc:
                    self.req.abort(exc)
                    return nothing_sent()
                if more:
                    if not out:
                        return nothing_sent()  # part of an event: held until it is whole
                    if self.kept is not None:
                        self.kept.append(out)
                    if out is chunk:
                        return self._send(message)  # whole events as they came: passed as is
                    return self._send(
                        {"type": "http.response.body", "body": out, "more_body": True}
                    )
                observer.end()
                if not observer.complete:
                    # Truncated: the caller gets the events so far, then (from Failover,
                    # once the app returns) an error event, never a silently short answer.
                    if out:
                        if self.kept is not None:
                            self.kept.append(out)
                        return self._send(
                            {"type": "http.response.body", "body": out, "more_body": True}
                        )
                    return nothing_sent()
                self._guard.done = True
                return self._send({"type": "http.response.body", "body": out, "more_body": False})
            observer.body(chunk)
            if not more:
                observer.end()
                self._guard.done = True
            return self._send(message)
        if message["type"] == "http.response.start" and not self.req.aborted:
            self._on_start(message)  # nothing to send yet: no coroutine of ours
            return nothing_sent()
        return self._before_commit(message)

    def _on_start(self, message: Message) -> None:
        status = int(message["status"])
        headers = list(message.get("headers", ()))
        self.observer.start(status, headers)
        if status in self._failover.retry_statuses or status == _NOT_FOUND:
            self.refusal = []  # kept for its message; the chain advances
            return
        self.start = {**message, "headers": headers}
        self.outcome = "ok" if status < 400 else f"http_{status}"

    async def _before_commit(self, message: Message) -> None:
        if self.req.aborted:
            return  # on its way out: nothing more goes to the caller
        kind = message["type"]
        observer = self.observer
        if kind == "http.response.start":
            self._on_start(message)
            return
        if kind != "http.response.body":
            if self.committed or self.start is None:
                await self._send(message)  # e.g. http.response.trailers, passed as-is
            return
        chunk: bytes = message.get("body", b"")
        more = bool(message.get("more_body", False))
        if self.refusal is not None:
            if chunk and sum(map(len, self.refusal)) < _REFUSAL_LIMIT:
                self.refusal.append(chunk)
            if not more:
                observer.end()
            return
        if self.start is None:
            raise RuntimeError("the inner app sent a body before http.response.start")
        if self.committed:
            await self.send(message)  # a trailer-less body after commit: the usual path
            return
        if observer.sse or observer.ndjson:
            try:
                out = observer.body(chunk)
            except StreamError as exc:
                self.req.abort(exc)
                return
            if observer.first_data_at is None:
                # Comments and pings before the first data event: held with it.
                if out:
                    if self._held_size + len(out) > _COMMENT_LIMIT and not observer.opened:
                        self._held = None  # comments only, none of them progress
                        self._held_size = 0
                    self._hold(out)
                if not more:
                    observer.end()  # no data at all: the attempt fails (no_data)
                return
            if not more:
                observer.end()
                if not observer.complete:
                    return  # whole stream, nothing sent, but truncated: fail over
            await self.commit(self.held_body() + out if self._held else out, more_body=more)
            return
        observer.body(chunk)
        if not more:
            observer.end()
            self._hold(chunk)  # whole: committed by Failover once the app returns
            return
        self._hold(chunk)
        if self._held_size > self._failover.hold_limit:
            await self.commit_held(more_body=True)  # too large to hold: stream on

    def _hold(self, chunk: bytes) -> None:
        if chunk:
            if self._held is None:
                self._held = [chunk]
            else:
                self._held.append(chunk)
            self._held_size += len(chunk)

    def held_body(self) -> bytes:
        """Everything held so far, released."""
        held = self._held
        if held is None:
            return b""
        self._held = None
        self._held_size = 0
        return held[0] if len(held) == 1 else b"".join(held)

    def failure(self) -> AttemptError | None:
        """Why the attempt failed, judged once the app returned (None: it answered)."""
        observer = self.observer
        if self.refusal is not None:
            assert observer.status is not None
            return RetryableStatus(
                observer.status,
                retry_after=retry_after(observer.headers),
                detail=error_detail(b"".join(self.refusal)),
            )
        if self.start is None:
            return AttemptError("the handler returned without answering", reason="no_response")
        if self.committed:
            if observer.ended and observer.complete:
                return None
            if observer.framed and observer.ended:
                return StreamError("the stream ended without its terminator", reason="truncated")
            return BackendUnavailable("the response ended before it was whole", reason="truncated")
        if observer.framed:
            if observer.first_data_at is None:
                return StreamError("the event stream carried no data event", reason="no_data")
            return StreamError("the stream ended without its terminator", reason="truncated")
        if not observer.ended:
            return BackendUnavailable(
                "the handler returned before the response was whole", reason="truncated"
            )
        if (
            observer.status == 400
            and not self.attempt.is_last
            and self._held
            and context_exceeded(b"".join(self._held))
        ):
            # The request does not fit this tier's context window: a later tier may
            # have a larger one. Not the backend's failure (its breaker sees a 400).
            return AttemptError(
                "the request exceeds the backend's context window", reason="context_exceeded"
            )
        return None

    async def conclude(self, error: BaseException | None) -> bool:
        """Settle the attempt once the app has returned (or failed): commit a held
        answer, end a broken one, or count the failure. True when the caller has
        its answer (the chain stops); False to fail over."""
        failover, req, attempt = self._failover, self.req, self.attempt
        if isinstance(error, CallerStalled):
            await self.caller_stalled(error)  # raises: the server drops the connection
        if error is None:
            if not self.committed:
                await self.commit_held(more_body=False)
            failover._record(req, attempt, self.outcome)
            return True
        if self.committed and self.observer.reached_end():
            # Every event and the terminator reached the caller; only the transport
            # broke after: a whole answer, ended cleanly.
            self.observer.end()
            self._guard.done = True
            await self._to_caller({"type": "http.response.body", "body": b"", "more_body": False})
            failover._record(req, attempt, self.outcome)
            return True
        outcome = self.outcome = error.reason if isinstance(error, AttemptError) else "error"
        if self.committed:
            # False: the stream goes on from the next tier (a continuation).
            return not await self.fail_after_commit(error, outcome)
        if not isinstance(error, AttemptError):
            log_event(
                "dispatch.attempt_error",
                level=40,
                route=attempt.route,
                backend=attempt.backend.name,
                error=repr(error),
            )
        self.fault = failover._failed(req, attempt, error, outcome)
        return False

    def end(self) -> Any:
        """The attempt is over: end its span. Returns its in-flight lease to give back."""
        self._ended = True
        guard = self._guard
        if guard.then is not None:
            guard.then = None  # (only the committed attempt sets it)
        if self._caller_watch is not None:
            deadlines.cancel(self._caller_watch)
            self._caller_watch = None
        span = self.span
        if span is not INVALID_SPAN:  # (no SDK: nothing to record)
            span.set_attribute(ATTR_OUTCOME, self.outcome)
            if self.attempt.backend.regime is None and self.outcome == "saturated":
                span.set_attribute(ATTR_REGIME, "saturated")
            span.end()
        lease, self.lease = self.lease, None
        return lease

    async def commit_held(self, *, more_body: bool) -> None:
        """Commit what is held, in the pieces it came in: never joined, each let go once
        sent, so a held answer costs about its own size (a join cost twice that, and the
        server's copy of one large body a third time)."""
        if self.race is not None and not self.race.claim(self):  # [hedge] lost the race
            return
        held, size = self._held, self._held_size
        self._held = None
        self._held_size = 0
        if held is None or len(held) == 1:
            return await self.commit(held[0] if held else b"", more_body=more_body)
        last = len(held) - 1
        await self.commit(held[0], more_body=True, length=None if more_body else size)
        held[0] = b""
        for i in range(1, last + 1):
            chunk, held[i] = held[i], b""
            if i == last and not more_body:
                self._guard.done = True
            message = {
                "type": "http.response.body",
                "body": chunk,
                "more_body": more_body or i < last,
            }
            await self._to_caller(message)

    async def commit(self, chunk: bytes, *, more_body: bool, length: int | None = None) -> None:
        """Send the held start and ``chunk``: the point of no return.

        ``length``: the whole body's, when ``chunk`` is its first piece of several."""
        assert self.start is not None
        if self.race is not None and not self.race.claim(self):  # [hedge] lost the race
            return
        req, attempt, observer = self.req, self.attempt, self.observer
        self.committed = True
        req.committed = True
        elapsed = clock.now() - attempt.started
        labelled(TIME_TO_FIRST_CHUNK, attempt.route or "", attempt.backend.name).observe(elapsed)
        headers: Headers = self.start["headers"]
        if observer.sse or observer.ndjson or (more_body and length is None):
            # The length may change (a partial event dropped, an error event added,
            # state lines put in front): let the server frame the body itself.
            headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        elif _has_body(observer.status):
            headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
            headers.append(
                (b"content-length", str(len(chunk) if length is None else length).encode())
            )
        # The gateway's own x-tierchain-* headers win: an upstream's never reach the caller.
        headers = [(k, v) for k, v in headers if not k.lower().startswith(_OWN_HEADERS)]
        backend = attempt.backend
        if backend.pool is None:
            trail = format_trail(req.attempts, (backend.name, self.outcome))
            req.emit("generating", backend=backend.name)
        else:
            trail = format_trail(
                req.attempts, (f"{backend.name};pool={backend.pool}", self.outcome)
            )
            req.emit("generating", backend=backend.name, pool=backend.pool)
        headers.append((TRAIL_HEADER, trail))
        headers.append((BACKEND_HEADER, backend.name.encode()))
        self.start["headers"] = headers
        if (
            more_body
            and attempt.n < attempt.of
            and (observer.sse or observer.ndjson)
            and self._failover._continuable.get(attempt.route or "")
        ):
            self.kept = [chunk]
            req.continuable = True
        self._watch_caller()
        await self._to_caller(self.start)
        if not more_body:
            self._guard.done = True
        await self._to_caller({"type": "http.response.body", "body": chunk, "more_body": more_body})

    async def fail_after_commit(self, exc: BaseException, outcome: str) -> bool:
        """End a committed response after its attempt failed mid-way, or (True) leave it
        open for a continuation on the next tier."""
        attempt = self.attempt
        self._failover._record(self.req, attempt, outcome)
        log_event(
            "dispatch.stream_failed",
            level=30,
            route=attempt.route,
            backend=attempt.backend.name,
            outcome=outcome,
            error=repr(exc),
        )
        error = self.observer.error_bytes(
            f"backend {attempt.backend.name!r} failed mid-stream ({outcome})",
            "upstream_error",
            outcome,
        )
        if error is None:
            raise exc  # not a stream: let the server abort the connection
        self.observer.drop_pending()  # a partial event never reaches the caller
        self._guard.done = True
        # The backend is done with: its place goes back before the caller is written
        # to, and that write is bounded by send_timeout like every other.
        lease, self.lease = self.lease, None
        if lease is not None:
            await self._failover.admission.leave(lease)
        kept, self.kept = self.kept, None
        observer = self.observer
        if kept is not None and self._failover._continue(
            self.req, attempt, observer.wire, observer.ndjson, kept, error
        ):
            self._guard.done = False  # the stream goes on: the caller is watched again
            return True
        await self._to_caller({"type": "http.response.body", "body": error, "more_body": False})
        return False

    async def caller_stalled(self, error: CallerStalled) -> None:
        """The caller stopped reading: record it (never the backend's failure), give
        the lease back, and raise, so the server drops the connection. Nothing more is
        written: it would wait on the same caller."""
        self.outcome = error.reason
        self._failover._record(self.req, self.attempt, error.reason)
        lease, self.lease = self.lease, None
        if lease is not None:
            await self._failover.admission.leave(lease)
        raise error

    # -- the caller's side: send_timeout -------------------------------------------

    async def _to_caller(self, message: Message) -> None:
        """One of Failover's own sends to the caller, marked as out while it is
        (``TierRequest.caller_blocked_since``); the cut turns into CallerStalled."""
        req = self.req
        req.caller_blocked_since = clock.now()
        try:
            await self._send(message)
        except asyncio.CancelledError:
            if not self.caller_cut or not _own_abort(req):
                raise
            error = req.attempt_error
            assert isinstance(error, CallerStalled)
            raise error from None
        req.caller_blocked_since = None
        req.caller_unblocked_at = clock.now()

    def _watch_caller(self) -> None:
        """From the commit on: look every ``send_timeout`` for a send out that long.

        A request younger than the disconnect guard's ``WATCH_AFTER`` (20 ms) starts
        its watch then, from the guard's own queue: most answers are over by then and
        never pay for a deadline (a cut comes at most that much later)."""
        if self._failover.send_timeout is None or self._caller_watch is not None:
            return
        guard = self._guard
        if guard.young:
            guard.then = self._arm_caller_watch
        else:
            self._arm_caller_watch()

    def _arm_caller_watch(self) -> None:
        timeout = self._failover.send_timeout
        if timeout is None or self._caller_watch is not None or self._ended:
            return
        self._task = self._guard.task
        self._caller_watch = deadlines.schedule(timeout, self._caller_due)

    def _caller_due(self) -> None:
        """The watch's call: cut the caller if a send has been out for send_timeout,
        else look again when the send out now would reach it."""
        self._caller_watch = None
        timeout = self._failover.send_timeout
        assert timeout is not None
        req = self.req
        since = req.caller_blocked_since
        if since is None:
            self._caller_watch = deadlines.schedule(timeout, self._caller_due)
            return
        now = clock.now()
        left = since + timeout - now
        if left > EARLY:  # (the scheduler may call this that early)
            self._caller_watch = deadlines.schedule(left, self._caller_due, fixed=False)
            return
        task = self._task
        if task is None or task.done() or req.aborted:
            return  # on its way out already
        self.caller_cut = True
        req.attempt_error = caller_cut(req, "relay")
        req.aborted = True
        assert req.interruption is not None  # armed on entry
        req.interruption.interrupt("tierchain: caller_stalled")


def _has_body(status: int | None) -> bool:
    return status is not None and status >= 200 and status not in (204, 304)


class _Continuation:
    """A broken stream being finished on a later tier (``TierRequest.continuation``)."""

    __slots__ = ("body", "done", "error", "ndjson", "origin", "seam", "sent", "wire")

    def __init__(
        self,
        seam: Seam,
        error: bytes,
        done: int,
        origin: str,
        sent: list[bytes],
        body: bytes,
        wire: str | None,
        ndjson: bool,
    ) -> None:
        self.seam = seam
        self.error = error  # the original break, in the caller's format
        self.done = done  # continuations started for this request
        self.origin = origin  # the backend whose answer is being finished
        self.sent = sent  # every event the caller has (kept by reference)
        self.body = body  # the caller's own request
        self.wire = wire
        self.ndjson = ndjson


class _Continuing(_Responder):
    """The ``send`` of an attempt that finishes a broken answer: nothing of its head
    reaches the caller; its whole events are spliced into the caller's stream
    (:meth:`~tierchain.continuation.Seam.splice`). Any failure before its first event
    ends the stream with the original break; a 400 is the backend refusing the
    continuation (``prefill_rejected``), never the caller's error."""

    __slots__ = ("continuation",)

    def __init__(
        self,
        failover: Failover,
        req: TierRequest,
        attempt: Attempt,
        observer: Observer,
        send: Send,
        guard: DisconnectGuard,
        span: Span,
        continuation: _Continuation,
    ) -> None:
        super().__init__(failover, req, attempt, observer, send, guard, span)
        self.continuation = continuation

    def send(self, message: Message) -> Awaitable[None]:
        if self.req.aborted:
            return nothing_sent()
        kind = message["type"]
        observer = self.observer
        if kind == "http.response.start":
            status = int(message["status"])
            headers = list(message.get("headers", ()))
            observer.start(status, headers)
            self.start = message
            cont = self.continuation
            same = observer.ndjson if cont.ndjson else observer.sse
            if status >= 300 or not same:
                self.refusal = []  # kept for its message; the caller never sees it
            return nothing_sent()
        if kind != "http.response.body":
            return nothing_sent()
        chunk: bytes = message.get("body", b"")
        more = bool(message.get("more_body", False))
        if self.refusal is not None:
            if chunk and sum(map(len, self.refusal)) < _REFUSAL_LIMIT:
                self.refusal.append(chunk)
            if not more:
                observer.end()
            return nothing_sent()
        if self.start is None:
            raise RuntimeError("the inner app sent a body before http.response.start")
        try:
            out = observer.body(chunk)
        except StreamError as exc:
            self.req.abort(exc)
            return nothing_sent()
        seam = self.continuation.seam
        try:
            spliced = seam.splice(out) if out else b""
        except Exception as exc:  # an event of a shape the format's rules do not expect
            self.req.abort(StreamError(f"could not splice: {exc!r}", reason="malformed_stream"))
            return nothing_sent()
        if not more:
            observer.end()
            if observer.complete:
                spliced += seam.finish()
                self._guard.done = True
                return self._to_caller(
                    {"type": "http.response.body", "body": spliced, "more_body": False}
                )
        if not spliced:
            return nothing_sent()
        if not self.committed:
            self.committed = True  # the first of its events reaches the caller
            self.req.emit("generating", **_named(self.attempt.backend))
            self._watch_caller()
        self.continuation.sent.append(spliced)
        return self._to_caller({"type": "http.response.body", "body": spliced, "more_body": True})

    def failure(self) -> AttemptError | None:
        observer = self.observer
        if self.refusal is not None:
            status = observer.status
            detail = error_detail(b"".join(self.refusal))
            if status == 400:
                return AttemptError(
                    f"the backend refused the continuation: {detail}", reason="prefill_rejected"
                )
            if status is not None and status >= 300:
                return RetryableStatus(
                    status, retry_after=retry_after(observer.headers), detail=detail
                )
            return StreamError("the answer was not in the stream's own framing", reason="no_data")
        if self.start is None:
            return AttemptError("the handler returned without answering", reason="no_response")
        if observer.ended and observer.complete:
            return None
        if observer.first_data_at is None:
            return StreamError("the event stream carried no data event", reason="no_data")
        return StreamError("the stream ended without its terminator", reason="truncated")

    async def conclude(self, error: BaseException | None) -> bool:
        failover, req, attempt = self._failover, self.req, self.attempt
        cont = self.continuation
        if isinstance(error, CallerStalled):
            await self.caller_stalled(error)  # raises
        route = attempt.route or ""
        target = attempt.backend.name
        observer = self.observer
        if error is not None and self.refusal is None and self.committed and observer.reached_end():
            # Every event and the terminator reached the caller; only the transport broke
            # after (or the final message was already sent): a whole answer.
            error = None
            if not self._guard.done:
                observer.end()
                self._guard.done = True
                tail = {"type": "http.response.body", "body": b"", "more_body": False}
                await self._to_caller(tail)
        if error is None:
            req.continuation = None
            failover._record(req, attempt, "ok")
            labelled(CONTINUATIONS, route, cont.origin, target, "ok").inc()
            log_event(
                "dispatch.continuation",
                route=route,
                outcome="ok",
                after_chars=len(cont.seam.text),
                added_chars=len(cont.seam.sent_text),
                origin=cont.origin,
                backend=target,
            )
            return True
        outcome = self.outcome = error.reason if isinstance(error, AttemptError) else "error"
        failover._record(req, attempt, outcome)
        spliced = cont.seam.spliced
        result = "rejected" if outcome == "prefill_rejected" else "broken" if spliced else "failed"
        labelled(CONTINUATIONS, route, cont.origin, target, result).inc()
        log_event(
            "dispatch.continuation",
            level=30,
            route=route,
            outcome=result,
            error=repr(error),
            after_chars=len(cont.seam.text),
            origin=cont.origin,
            backend=target,
        )
        lease, self.lease = self.lease, None
        if lease is not None:
            await failover.admission.leave(lease)
        self.observer.drop_pending()
        shown = cont.error
        if spliced:
            # It broke in its turn, after some of its text reached the caller: that break
            # is the caller's error now.
            own = self.observer.error_bytes(
                f"backend {target!r} failed mid-stream ({outcome})", "upstream_error", outcome
            )
            shown = own if own is not None else shown
        if failover._continue(req, attempt, cont.wire, cont.ndjson, cont.sent, shown):
            return False  # one more continuation, on the tier after this one
        self._guard.done = True
        await self._to_caller({"type": "http.response.body", "body": shown, "more_body": False})
        return True
