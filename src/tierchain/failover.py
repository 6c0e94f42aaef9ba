"""Failover: own the chain, call the inner app once per attempt.

Per request: buffer the body (at most ``max_body``; 413 beyond), resolve the
route (404 for an unknown model, 400 for a body that cannot name one), apply
any reorderings that outer layers registered (PreferBackend, pins) while
refusing any that would drop a backend, then try the chain in order.

An attempt's ``http.response.start`` is held back until its first chunk (for an
event stream, the first event carrying ``data:``; comments before it are held
with it). Until then the attempt may still fail over: on an
:class:`~tierchain.errors.AttemptError`, any other exception, or a retryable
status. After the first byte has gone to the caller there is no failover: a
later failure ends an event stream with an OpenAI-style error event, and
aborts any other body (the server then closes the connection, so the caller
sees an incomplete response rather than a silently short one).

When the caller disconnects, the running attempt is cancelled.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

from opentelemetry.trace import Span, Status, StatusCode

from ._body import CallerGone, read_body
from ._disconnect import DisconnectGuard
from ._responses import header, send_json_error
from ._types import ASGIApp, Headers, Message, Receive, Scope, Send
from .backend import Backend, Routes
from .errors import (
    AttemptError,
    BackendSaturated,
    BackendSkipped,
    BodyTooLarge,
    BudgetExhausted,
    RetryableStatus,
)
from .request import TRAIL_HEADER, UNROUTED_KEY, Attempt, AttemptRecord, TierRequest, format_trail
from .sse import EventTail, FirstChunk, error_event, is_event_stream
from .telemetry import (
    ATTEMPTS,
    ATTR_ATTEMPT_N,
    ATTR_ATTEMPT_OF,
    ATTR_BACKEND,
    ATTR_OUTCOME,
    ATTR_REGIME,
    ATTR_ROUTE,
    TIME_TO_FIRST_CHUNK,
    labelled,
    log_event,
    start_span,
)

__all__ = ["DEFAULT_RETRY_STATUSES", "Failover", "ResolveError"]

DEFAULT_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
BACKEND_HEADER = b"x-tierchain-backend"
_HOLD_LIMIT = 64 * 1024  # comment bytes held before the first data event


class ResolveError(ValueError):
    """Raised by a resolver when the body cannot name a route: answered 400."""


Resolver = Callable[[Scope, bytes], str]


def _json_body(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ResolveError(f"the request body is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ResolveError("the request body must be a JSON object with a string 'model'")
    return data


def _retry_after(headers: Headers) -> float | None:
    value = header(headers, b"retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


class Failover:
    """Own the chain: one call of the inner app per attempt, until one answers.

    ``routes`` maps a logical model to its chain (a :class:`Routes` or a plain
    mapping). ``resolve(scope, body) -> route`` replaces the default, which
    reads the OpenAI-compatible JSON body's ``model``. ``retry_statuses`` are
    the statuses that advance the chain when they arrive before anything was
    sent. Every response carries ``x-tierchain-attempts``, the attempt trail.

    Only ``POST`` requests whose path starts with one of ``paths`` are routed;
    anything else (``GET /v1/models``, a health check, an admin page) passes
    straight through to the inner app with no attempt.
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
    ) -> None:
        self.app = app
        # Matched against the raw path: routers (a Litestar mount) rewrite scope["path"].
        self.paths = tuple(p.encode() for p in paths)
        self.routes = routes if isinstance(routes, Routes) else Routes(routes)
        if max_body < 0:
            raise ValueError(f"max_body must be >= 0, got {max_body}")
        self.max_body = int(max_body)
        self.resolve = resolve
        self.retry_statuses = frozenset(retry_statuses)
        self._known = ", ".join(sorted(self.routes))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or not (scope.get("raw_path") or scope["path"].encode()).startswith(self.paths)
        ):
            if scope["type"] == "http":
                scope[UNROUTED_KEY] = True
            return await self.app(scope, receive, send)
        req = TierRequest.of(scope)
        try:
            body = await read_body(scope, receive, self.max_body)
        except BodyTooLarge as exc:
            return await send_json_error(
                send, 413, str(exc), "request_too_large", "body_too_large", limit=exc.limit
            )
        except CallerGone:
            return
        req.body = body
        route = await self._route(scope, req, body, send)
        if route is None:
            return
        chain = self.routes[route]
        for reorder in req.reorderers:
            chain = await self._reordered(route, chain, reorder)
        req.route = route
        req.chain = chain
        req.in_chain = True

        span = start_span("tierchain.request", {ATTR_ROUTE: route})
        try:
            async with DisconnectGuard(receive) as guard:
                await self._run(scope, req, guard, send, span)
        finally:
            span.end()

    async def _route(self, scope: Scope, req: TierRequest, body: bytes, send: Send) -> str | None:
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
            await send_json_error(send, 400, str(exc), "invalid_request_error", "invalid_body")
            return None
        if route not in self.routes:
            shown = route if len(route) <= 200 else route[:200] + "..."
            await send_json_error(
                send,
                404,
                f"no route for model {shown!r}; known routes: {self._known}",
                "invalid_request_error",
                "model_not_found",
            )
            return None
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

    async def _run(
        self, scope: Scope, req: TierRequest, guard: DisconnectGuard, send: Send, span: Span
    ) -> None:
        chain = req.chain
        of = len(chain)
        skipped: dict[str, float | None] = {}
        for n, backend in enumerate(chain, 1):
            if await self._attempt(scope, req, guard, send, Attempt(n, of, backend, req.route)):
                span.set_attribute(ATTR_OUTCOME, "ok")
                return
            last = req.attempts[-1]
            if last.outcome == "skipped":
                skipped[backend.name] = req.extras.get(f"retry_in:{backend.name}")
        if len(skipped) == of and req.extras.get("on_all_open") == "try_soonest":
            name = min(skipped, key=lambda b: skipped[b] or 0.0)
            soonest = next(b for b in chain if b.name == name)
            attempt = Attempt(of, of, soonest, req.route, force=True)
            if await self._attempt(scope, req, guard, send, attempt):
                span.set_attribute(ATTR_OUTCOME, "ok")
                return
        guard.done = True
        span.set_attribute(ATTR_OUTCOME, "all_failed")
        span.set_status(Status(StatusCode.ERROR, "every backend failed"))
        trail = [(TRAIL_HEADER, format_trail(req.attempts))]
        if len(skipped) == of:
            soonest_s = min((s for s in skipped.values() if s is not None), default=1.0)
            retry = max(1, math.ceil(soonest_s))
            await send_json_error(
                send,
                503,
                f"every backend for route {req.route!r} is cooling down; retry in {retry}s",
                "all_backends_open",
                "service_unavailable",
                headers=[*trail, (b"retry-after", str(retry).encode())],
                backends=[
                    {"backend": b, "state": "open", "retry_in_s": s} for b, s in skipped.items()
                ],
            )
            return
        await send_json_error(
            send,
            502,
            f"all {of} backends for route {req.route!r} failed",
            "all_backends_failed",
            "bad_gateway",
            headers=trail,
            attempts=[{"backend": r.backend, "outcome": r.outcome} for r in req.attempts],
        )

    async def _attempt(
        self, scope: Scope, req: TierRequest, guard: DisconnectGuard, send: Send, attempt: Attempt
    ) -> bool:
        """Run one attempt; True when it answered the caller (or the caller left)."""
        if req.deadline is not None:
            attempt.deadline = req.deadline
            if attempt.deadline <= time.monotonic():
                raise BudgetExhausted("the request's budget was spent before the next attempt")
        backend = attempt.backend
        req.attempt = attempt
        req.extras.pop("attempt_error", None)
        req.emit("attempt", n=attempt.n, of=attempt.of, backend=backend.name, regime=backend.regime)
        responder = _Responder(self, req, attempt, send, guard)
        attrs: dict[str, str | int] = {
            ATTR_ROUTE: attempt.route or "",
            ATTR_BACKEND: backend.name,
            ATTR_ATTEMPT_N: attempt.n,
            ATTR_ATTEMPT_OF: attempt.of,
        }
        if backend.regime:
            attrs[ATTR_REGIME] = backend.regime
        span = start_span("tierchain.attempt", attrs)
        outcome = "ok"
        recorded = len(req.attempts)
        try:
            try:
                # A fresh copy per attempt: routers (Starlette's Mount, Litestar's) rewrite
                # the scope as they dispatch, and a replay must start from the original.
                await self.app(dict(scope), _replay(req.body or b"", guard), responder.send)
            except AttemptError as exc:
                outcome = exc.reason
                if responder.committed:
                    await responder.fail_after_commit(exc, outcome)
                    return True
                self._failed(req, attempt, exc, outcome)
                return False
            except Exception as exc:
                outcome = "error"
                if responder.committed:
                    await responder.fail_after_commit(exc, outcome)
                    return True
                log_event(
                    "dispatch.attempt_error",
                    level=40,
                    route=attempt.route,
                    backend=backend.name,
                    error=repr(exc),
                )
                self._failed(req, attempt, exc, outcome)
                return False
            if not responder.committed:
                if responder.start is None:
                    outcome = "no_response"
                    self._failed(req, attempt, None, outcome)
                    return False
                await responder.commit(b"", more_body=False)
            outcome = responder.outcome
            self._record(req, attempt, outcome)
            return True
        except BaseException:
            # Cancelled from outside: the caller left, or a layer such as Budget
            # ended the request and said why in req.extras["cancel_reason"].
            if len(req.attempts) == recorded:
                outcome = str(req.extras.get("cancel_reason", "cancelled"))
                self._record(req, attempt, outcome)
            raise
        finally:
            span.set_attribute(ATTR_OUTCOME, outcome)
            if backend.regime is None and outcome == "saturated":
                span.set_attribute(ATTR_REGIME, "saturated")
            span.end()

    def _record(self, req: TierRequest, attempt: Attempt, outcome: str) -> None:
        elapsed = time.monotonic() - attempt.started
        req.attempts.append(AttemptRecord(attempt.n, attempt.backend.name, outcome, elapsed))
        labelled(ATTEMPTS, attempt.route or "", attempt.backend.name, outcome).inc()

    def _failed(
        self, req: TierRequest, attempt: Attempt, exc: BaseException | None, outcome: str
    ) -> None:
        self._record(req, attempt, outcome)
        backend = attempt.backend.name
        failing_over = not attempt.is_last
        if isinstance(exc, BackendSkipped):
            req.extras[f"retry_in:{backend}"] = exc.retry_in
            req.emit(
                "backend_skipped",
                backend=backend,
                retry_in_s=None if exc.retry_in is None else round(exc.retry_in, 1),
                failing_over=failing_over,
            )
        elif isinstance(exc, BackendSaturated):
            req.emit("backend_saturated", backend=backend, failing_over=failing_over)
        else:
            req.emit("backend_failed", backend=backend, reason=outcome, failing_over=failing_over)
        log_event(
            "dispatch.attempt_failed",
            route=attempt.route,
            backend=backend,
            n=attempt.n,
            of=attempt.of,
            outcome=outcome,
            failing_over=failing_over,
        )


def _replay(body: bytes, guard: DisconnectGuard) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await guard.receive()

    return receive


class _Responder:
    """One attempt's view of ``send``: holds the start until the first chunk."""

    __slots__ = (
        "_detector",
        "_failover",
        "_guard",
        "_held",
        "_held_size",
        "_send",
        "_tail",
        "aborted",
        "attempt",
        "committed",
        "outcome",
        "req",
        "sse",
        "start",
    )

    def __init__(
        self,
        failover: Failover,
        req: TierRequest,
        attempt: Attempt,
        send: Send,
        guard: DisconnectGuard,
    ) -> None:
        self._failover = failover
        self.req = req
        self.attempt = attempt
        self._send = send
        self._guard = guard
        self.start: Message | None = None
        self.committed = False
        self.aborted: AttemptError | None = None
        self.sse = False
        self.outcome = "ok"
        self._detector: FirstChunk | None = None
        self._tail: EventTail | None = None
        self._held: list[bytes] = []
        self._held_size = 0

    def send(self, message: Message) -> Awaitable[None]:
        """The inner app's send. Once committed, returns the caller's send's own awaitable."""
        if self.committed:
            if message["type"] == "http.response.body":
                if self._tail is not None:
                    self._tail.feed(message.get("body", b""))
                if not message.get("more_body", False):
                    self._guard.done = True
            return self._send(message)
        return self._before_commit(message)

    async def _before_commit(self, message: Message) -> None:
        if self.aborted is not None:
            raise self.aborted
        kind = message["type"]
        if kind == "http.response.start":
            status = int(message["status"])
            headers = list(message.get("headers", ()))
            if status in self._failover.retry_statuses:
                # A framework may have turned a layer's AttemptError into this 500
                # (Litestar's handler does); the layer left the real cause behind.
                cause = self.req.extras.pop("attempt_error", None)
                if isinstance(cause, AttemptError):
                    self.aborted = cause
                else:
                    self.aborted = RetryableStatus(status, retry_after=_retry_after(headers))
                raise self.aborted
            self.start = {**message, "headers": headers}
            self.sse = is_event_stream(headers)
            if self.sse:
                self._detector = FirstChunk()
                self._tail = EventTail()
            self.outcome = "ok" if status < 400 else f"http_{status}"
            return
        if kind != "http.response.body":
            await self._send(message)  # e.g. http.response.trailers, passed as-is
            return
        if self.start is None:
            raise RuntimeError("the inner app sent a body before http.response.start")
        chunk: bytes = message.get("body", b"")
        more = bool(message.get("more_body", False))
        if more:
            if self._detector is not None:
                if not self._detector.feed(chunk) and self._held_size + len(chunk) < _HOLD_LIMIT:
                    if chunk:
                        self._held.append(chunk)
                        self._held_size += len(chunk)
                    return
            elif not chunk:
                return
        await self.commit(chunk, more_body=more)

    async def commit(self, chunk: bytes, *, more_body: bool) -> None:
        """Send the held start, anything held, and ``chunk``: the point of no return."""
        assert self.start is not None
        req, attempt = self.req, self.attempt
        self.committed = True
        elapsed = time.monotonic() - attempt.started
        labelled(TIME_TO_FIRST_CHUNK, attempt.route or "", attempt.backend.name).observe(elapsed)
        headers: Headers = self.start["headers"]
        trail = format_trail(req.attempts, (attempt.backend.name, self.outcome))
        headers.append((TRAIL_HEADER, trail))
        headers.append((BACKEND_HEADER, attempt.backend.name.encode()))
        req.emit("generating", backend=attempt.backend.name)
        await self._send(self.start)
        if self._held:
            chunk = b"".join(self._held) + chunk
            self._held.clear()
        if self._tail is not None:
            self._tail.feed(chunk)
        if not more_body:
            self._guard.done = True
        await self._send({"type": "http.response.body", "body": chunk, "more_body": more_body})

    async def fail_after_commit(self, exc: BaseException, outcome: str) -> None:
        """End a committed response after its attempt failed mid-way."""
        attempt = self.attempt
        self._failover._record(self.req, attempt, f"{outcome}_after_commit")
        log_event(
            "dispatch.stream_failed",
            level=30,
            route=attempt.route,
            backend=attempt.backend.name,
            outcome=outcome,
            error=repr(exc),
        )
        if self._tail is None:
            raise exc  # not an event stream: let the server abort the connection
        self._guard.done = True
        closing = self._tail.closing_bytes()
        await self._send(
            {
                "type": "http.response.body",
                "body": closing
                + error_event(
                    f"backend {attempt.backend.name!r} failed mid-stream ({outcome})",
                    "upstream_error",
                    outcome,
                ),
                "more_body": False,
            }
        )
