"""Forwarder: an ASGI app that sends the request to the current attempt's backend.

One shared :class:`httpx.AsyncClient` per Forwarder; the response is streamed
to the caller chunk by chunk as it arrives, never buffered. DNS, connect and
TLS together are bounded by ``connect_timeout`` (one deadline for the whole
connection set-up, disarmed once the request headers start to go out), so a
dead backend costs the caller that long at most and a refused connection costs
milliseconds. Waiting for the answer itself is bounded elsewhere: by the
SaturationWatchdog and the Budget.

Inside a Failover, a backend that cannot be reached (or breaks its stream)
is reported as :class:`~tierchain.errors.BackendUnavailable` in
``TierRequest.attempt_error``, and the handler returns without answering, so
the chain advances; no exception crosses the host framework. Used alone (with
``backend=``), it answers 502 itself, or ends a broken event stream with an
error event after the last whole event.

The request's ``accept-encoding`` is replaced by ``identity``: the stream is
passed through byte for byte and heartbeats need to see event boundaries.

Headers: hop-by-hop and ``proxy-*`` headers go neither way. The caller's
credentials (``authorization``, ``x-api-key``, ``api-key``, ``cookie``) reach a
backend only with ``Backend(forward_caller_auth=True)``; the backend's own
``headers`` replace any of the caller's. The caller's ``traceparent`` and
``tracestate`` are never passed on verbatim: with a tracer configured, the
current span's (the attempt's, inside a Failover) are injected instead. The
upstream's ``set-cookie``, ``date`` and ``server`` do not come back: the server
in front writes its own ``date`` and ``server``, once.

The upstream URL and the request-target check: see :mod:`tierchain._target`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import Mapping
from datetime import timedelta
from http.cookiejar import CookieJar
from typing import Any

import httpx
from opentelemetry import propagate

from . import _json
from ._body import DEFAULT_BODY_TIMEOUT, read_or_refuse, timeout_option
from ._checks import count, duration
from ._connections import FlatTransport, NotSent
from ._disconnect import DisconnectGuard
from ._head import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS, HeadLimits, refuse_request
from ._responses import RETRY_AFTER_MAX, retry_after, send_json_error
from ._runtime import clock, deadlines
from ._runtime import lag as loop_lag
from ._runtime.deadlines import EARLY
from ._target import BadTarget, Target, refuse, request_target, upstream_url
from ._types import Headers, Receive, Scope, Send
from .backend import Backend
from .errors import BackendUnavailable, StreamError
from .observer import Observer
from .request import TierRequest
from .sse import is_event_stream
from .telemetry import log_event, tracing_enabled
from .wire import recognise

__all__ = ["Forwarder"]

_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
"""Hop-by-hop headers (and every ``proxy-*`` header): never passed on, either way."""
_CALLER_AUTH = frozenset({b"authorization", b"x-api-key", b"api-key", b"cookie"})
"""The caller's credentials: passed on only to a backend with ``forward_caller_auth``."""
_TRACE_CONTEXT = frozenset({b"traceparent", b"tracestate"})
"""The caller's trace context: replaced by the attempt's (or dropped without a tracer)."""
_NOT_FORWARDED = _HOP_BY_HOP | _TRACE_CONTEXT | {b"host", b"content-length", b"accept-encoding"}
_NOT_RETURNED = _HOP_BY_HOP | {b"set-cookie", b"date", b"server"}
"""``date`` and ``server`` come from the server in front (uvicorn adds its own)."""
# A connect timeout counts as the gateway's own when its event loop ran this share of
# the connect timeout late while it waited.
_LAG_SHARE = 0.25
# A backend is given at most this many fresh connect windows for the gateway's lag.
_EXTENSIONS = 3
_HEADERS_SENT = frozenset(
    {"http11.send_request_headers.started", "http2.send_request_headers.started"}
)


def _connection_tokens(headers: Headers) -> frozenset[bytes]:
    tokens: set[bytes] = set()
    for key, value in headers:
        if key.lower() == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b","))
    return frozenset(tokens)


class Forwarder:
    """Forward each request to ``current_attempt(scope).backend`` (or ``backend``).

    ``connect_timeout`` bounds DNS, connect and TLS together. ``backend`` is
    the target when no Failover runs in front. ``client`` lets a caller supply
    its own ``httpx.AsyncClient`` (then the caller closes it). Close the
    Forwarder with ``await forwarder.aclose()`` (or ``async with``); as the root
    app it also closes on lifespan shutdown.

    Options: [Forwarder](forwarder.md).
    """

    def __init__(
        self,
        *,
        connect_timeout: float | timedelta = 2.0,
        backend: Backend | None = None,
        client: httpx.AsyncClient | None = None,
        max_keepalive: int = 64,
        max_body: int = 32 * 2**20,
        body_timeout: float | timedelta | None = DEFAULT_BODY_TIMEOUT,
        max_headers: int = DEFAULT_MAX_HEADERS,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    ) -> None:
        self.connect_timeout = duration("connect_timeout", connect_timeout)
        self.backend = backend
        self.max_body = count("max_body", max_body, minimum=0)
        self.body_timeout = timeout_option("body_timeout", body_timeout)
        self._head = HeadLimits(max_headers, max_header_bytes)
        self._own_client = client is None
        self._client = client
        self._transport: FlatTransport | None = None
        self._max_keepalive = count("max_keepalive", max_keepalive, minimum=0)
        self._timeouts = {
            # connect_timeout itself is applied by _forward (with patience for the
            # gateway's own lag); httpcore's bound is only a backstop.
            "connect": self.connect_timeout * (_EXTENSIONS + 2),
            "read": None,
            "write": None,
            "pool": None,
        }

    @property
    def client(self) -> httpx.AsyncClient:
        """The shared client, created on first use."""
        if self._client is None:
            limits = httpx.Limits(
                max_connections=None, max_keepalive_connections=self._max_keepalive
            )
            # Its cost per request does not grow with the streams held (see _connections).
            self._transport = FlatTransport(limits=limits)
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(**self._timeouts),
                limits=limits,
                transport=self._transport,
                follow_redirects=False,
                trust_env=False,
                cookies=_NoCookies(),
            )
        return self._client

    async def aclose(self) -> None:
        """Close the shared client and every pooled connection."""
        client, self._client = self._client, None
        if client is not None and self._own_client:
            await client.aclose()

    async def __aenter__(self) -> Forwarder:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            raise RuntimeError(f"Forwarder serves http scopes only, not {scope['type']!r}")
        try:
            target = request_target(scope)
        except BadTarget as exc:
            return await refuse(scope, send, exc)
        req = TierRequest.find(scope)
        attempt = req.attempt if req is not None else None
        backend = attempt.backend if attempt is not None else self.backend
        if backend is None:
            # Nothing routed it here (no Failover route, no backend of its own): not found.
            return await _unrouted(scope, send)
        guard: DisconnectGuard | None = None
        chained = req.body if req is not None and req.in_chain else None
        raise_errors = chained is not None
        if chained is not None:
            body = chained  # Failover read it (and checked the head), and watches the caller
        else:
            refused = self._head.problem(scope)
            if refused is not None:
                return await refuse_request(scope, send, *refused)
            read = await read_or_refuse(scope, receive, send, self.max_body, self.body_timeout)
            if read is None:
                return  # answered 413 or 408, or the caller left
            body = read
            guard = DisconnectGuard(receive)
            guard.enter()
        # The request, in this frame (a request waiting on its backend holds one of ours).
        try:
            request = self._build(scope, target, body, backend)
            setup = _Setup(self.connect_timeout)
            request.extensions["trace"] = setup.trace
            try:
                async with setup.timer:
                    response = await self._send(request)
            except (httpx.TransportError, TimeoutError) as exc:
                return await self._unreached(scope, send, backend, exc, setup, raise_errors)
            finally:
                setup.close()
                # Set-up is over: nothing more to trace, and nothing kept for it while
                # the answer streams or the backend keeps the request waiting.
                del request.extensions["trace"]
            if not 100 <= response.status_code <= 599:
                await response.aclose()
                return await self._unavailable(
                    scope,
                    send,
                    backend,
                    "protocol_error",
                    raise_errors,
                    detail=f"answered status {response.status_code}, which HTTP does not define",
                )
            await self._relay(scope, response, backend, send, raise_errors)
            if guard is not None:
                guard.done = True
        except asyncio.CancelledError:
            if guard is None:
                raise
            guard.close()
            if not guard.caused_cancellation():
                raise  # not the caller leaving
        finally:
            if guard is not None:
                guard.close()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _send(self, request: httpx.Request) -> httpx.Response:
        """Send ``request``; with our own client, straight to its transport.

        The client's own ``send`` adds nothing the Forwarder needs and walks the
        cookie jar on every response, at a cost quadratic in the request's header
        count (httpx copies the headers into a dict key by key); a supplied
        ``client`` is used as it is, cookies and hooks included.
        """
        client = self.client
        transport = self._transport
        if transport is None:
            return await client.send(request, stream=True)
        return await transport.handle_async_request(request)

    def _build(self, scope: Scope, target: Target, body: bytes, backend: Backend) -> httpx.Request:
        raw: Headers = scope.get("headers", [])
        dropped = _NOT_FORWARDED | _connection_tokens(raw)
        if not backend.forward_caller_auth:
            dropped |= _CALLER_AUTH
        headers = [(k, v) for k, v in raw if not _dropped(k, dropped)]
        headers.append((b"accept-encoding", b"identity"))
        own = {key.lower().encode(): value.encode() for key, value in backend.headers.items()}
        if tracing_enabled():
            # The current span is the attempt's (Failover makes it current for its app).
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            for key, value in carrier.items():
                own.setdefault(key.lower().encode(), value.encode())
        if own:
            headers = [(k, v) for k, v in headers if k.lower() not in own]
            headers.extend(own.items())
        if backend.model is not None and body:
            body = _rewrite_model(body, backend.model)
        url = upstream_url(backend.url, target)
        # Built as it is, without the client's default headers merged in (a merge that
        # costs a scan of the headers per header) and without its cookies.
        request = httpx.Request(
            scope["method"],
            url,
            headers=headers,
            content=body,
            extensions={"timeout": self._timeouts},
        )
        if self.client is not None and self._transport is not None:
            # What the client would do: the backend URL's userinfo as basic auth.
            user, password = request.url.username, request.url.password
            if user or password:
                userpass = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
                request.headers["authorization"] = f"Basic {userpass}"
        return request

    async def _unreached(
        self,
        scope: Scope,
        send: Send,
        backend: Backend,
        exc: Exception,
        setup: _Setup,
        raise_errors: bool,
    ) -> None:
        """The backend was not reached: say why (to Failover, or to the caller)."""
        if isinstance(exc, httpx.PoolTimeout):
            return await self._unavailable(
                scope, send, backend, "pool_timeout", raise_errors, gateway_fault=True
            )
        if isinstance(exc, (httpx.ConnectTimeout, TimeoutError)):
            # The gateway's own slowness is not the backend's failure: a deadline spent
            # waiting for a pooled connection, or while the event loop ran late.
            lag = loop_lag.lag_since(setup.window)
            if not setup.connecting:
                reason, ours = "pool_timeout", True
            else:
                reason, ours = "connect_timeout", lag >= self.connect_timeout * _LAG_SHARE
            return await self._unavailable(
                scope, send, backend, reason, raise_errors, gateway_fault=ours, lag=lag
            )
        if isinstance(exc, httpx.ConnectError):
            reason = "connect_refused"
        elif isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
            # Reset before any write of the request went through (the pool knows): the
            # backend never had it. After: it may have read it, and worked on it.
            reason = "not_sent" if isinstance(exc.__cause__, NotSent) else "connection_reset"
        else:
            reason = "protocol_error"
        await self._unavailable(scope, send, backend, reason, raise_errors)

    async def _relay(
        self,
        scope: Scope,
        response: httpx.Response,
        backend: Backend,
        send: Send,
        raise_errors: bool,
    ) -> None:
        """Stream the backend's answer to the caller."""
        # Alone, the Forwarder passes on whole events only (its own observer); inside a
        # Failover, Failover's observer does that.
        observer: Observer | None = None
        try:
            headers = _response_headers(response)
            if not raise_errors and is_event_stream(headers):
                observer = Observer(wire=recognise(scope.get("path", "")))
                observer.start(response.status_code, headers)
            await send(
                {"type": "http.response.start", "status": response.status_code, "headers": headers}
            )
            # The raw bytes as they arrive: what ``aiter_raw()`` yields, without its
            # per-chunk bookkeeping (a re-chunker that does nothing here, a byte count).
            stream = response.stream
            assert isinstance(stream, httpx.AsyncByteStream)
            # While a send to the caller is out, nothing is read from the upstream: the
            # request says so (TierRequest.caller_blocked_since), for the watchdog's
            # stall gap and Failover's send_timeout. Two clock reads a chunk, no task.
            req: TierRequest | _Unwatched = TierRequest.find(scope) or _Unwatched()
            async for chunk in stream:
                if observer is not None:
                    chunk = observer.body(chunk)
                if chunk:
                    message = {"type": "http.response.body", "body": chunk, "more_body": True}
                    req.caller_blocked_since = clock.now()
                    await send(message)
                    req.caller_blocked_since = None
                    req.caller_unblocked_at = clock.now()
            req.caller_blocked_since = clock.now()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            req.caller_blocked_since = None
            req.caller_unblocked_at = clock.now()
        except (httpx.TransportError, StreamError) as exc:
            if raise_errors:
                # Said without raising: a framework around this handler (Litestar's)
                # would turn an exception into a 500 of its own and log it.
                _leave_cause(
                    scope,
                    BackendUnavailable(
                        f"backend {backend.name!r} broke the stream: {exc!r}",
                        reason="stream_broken",
                    ),
                )
                return
            if observer is None:
                raise
            await send(
                {
                    "type": "http.response.body",
                    "body": observer.error_bytes(
                        f"backend {backend.name!r} failed mid-stream",
                        "upstream_error",
                        "stream_broken",
                    )
                    or b"",
                    "more_body": False,
                }
            )
        finally:
            await response.aclose()

    async def _unavailable(
        self,
        scope: Scope,
        send: Send,
        backend: Backend,
        reason: str,
        raise_errors: bool,
        *,
        gateway_fault: bool = False,
        lag: float = 0.0,
        detail: str | None = None,
    ) -> None:
        message = f"backend {backend.name!r} is unreachable ({reason})"
        if detail is not None:
            message = f"backend {backend.name!r} {detail} ({reason})"
        if gateway_fault:
            message = (
                f"backend {backend.name!r} was not reached in time because the gateway "
                f"is overloaded ({reason}, event loop {lag:.2f}s late)"
            )
            log_event(
                "forward.gateway_overloaded",
                level=30,
                backend=backend.name,
                reason=reason,
                loop_lag_s=round(lag, 3),
            )
        if raise_errors:
            cause = BackendUnavailable(message, reason=reason, gateway_fault=gateway_fault)
            _leave_cause(scope, cause)
            return  # Failover finds the cause; nothing was sent
        await send_json_error(send, 502, message, "upstream_unavailable", reason)


class _NoCookies(CookieJar):
    """A cookie jar that keeps nothing and adds nothing: an upstream's ``Set-Cookie``
    is not the gateway's to keep, nor to send on with another caller's request."""

    def add_cookie_header(self, request: Any) -> None:
        return None

    def extract_cookies(self, response: Any, request: Any) -> None:
        return None

    def set_cookie(self, cookie: Any) -> None:
        return None


class _Unwatched:
    """Where a Forwarder with no request object notes its sends to the caller (no one reads it)."""

    __slots__ = ("caller_blocked_since", "caller_unblocked_at")

    def __init__(self) -> None:
        self.caller_blocked_since: float | None = None
        self.caller_unblocked_at = 0.0


class _Setup:
    """One request's connection set-up deadline (DNS, connect, TLS), with patience
    for the gateway's own lag.

    Disarmed once the request headers start to go out. Just before the deadline,
    if the event loop ran late during the window, the lost time was the gateway's:
    the backend gets a fresh window (at most ``_EXTENSIONS`` of them).
    """

    __slots__ = ("check", "connecting", "extended", "held", "timeout", "timer", "window")

    def __init__(self, timeout: float) -> None:
        loop_lag.hold()  # the loop's lag is measured while a set-up is under way
        self.held = True
        self.timeout = timeout
        self.timer = asyncio.timeout(timeout)
        self.connecting = False  # a connection attempt started (not a wait for a pooled one)
        self.window = clock.now()
        self.extended = 0
        self.check: deadlines.Deadline | None = deadlines.schedule(timeout - EARLY, self.patience)

    def patience(self) -> None:
        timeout = self.timeout
        if loop_lag.lag_since(self.window) >= timeout * _LAG_SHARE and self.extended < _EXTENSIONS:
            self.extended += 1
            self.window = clock.now()
            self.timer.reschedule(asyncio.get_running_loop().time() + timeout)
            self.check = deadlines.schedule(timeout - EARLY, self.patience)
        else:
            self.check = None

    async def trace(self, name: str, info: Mapping[str, Any]) -> None:
        """httpcore's trace hook: notes a connection attempt, disarms on the headers."""
        if name in _HEADERS_SENT:
            self.timer.reschedule(None)  # connected: the set-up deadline is met
            self.close()
        elif name == "connection.connect_tcp.started":
            self.connecting = True

    def close(self) -> None:
        check = self.check
        if check is not None:
            self.check = None
            deadlines.cancel(check)
        if self.held:
            self.held = False
            loop_lag.release()


def _leave_cause(scope: Scope, error: BackendUnavailable) -> None:
    """Leave the real cause where Failover (and a Breaker) find it."""
    req = TierRequest.find(scope)
    if req is not None:
        req.attempt_error = error


def _dropped(key: bytes, dropped: frozenset[bytes]) -> bool:
    key = key.lower()
    return key in dropped or key.startswith(b"proxy-")


def _response_headers(response: httpx.Response) -> Headers:
    raw = response.headers.raw
    dropped = _NOT_RETURNED | _connection_tokens(list(raw))
    # (an upstream's x-tierchain-* never passes for the gateway's own)
    headers = [
        (k.lower(), v)
        for k, v in raw
        if not _dropped(k, dropped) and not k.lower().startswith(b"x-tierchain-")
    ]
    for i, (key, value) in enumerate(headers):
        if key == b"retry-after" and retry_after([(key, value)]) == RETRY_AFTER_MAX:
            # No caller is told more than the cap, not even by an answer passed on whole.
            headers[i] = (key, b"%d" % RETRY_AFTER_MAX)
    return headers


def _rewrite_model(body: bytes, model: str) -> bytes:
    try:
        data = _json.loads(body)
    except ValueError:
        return body
    if not isinstance(data, dict) or "model" not in data:
        return body
    data["model"] = model
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


async def _unrouted(scope: Scope, send: Send) -> None:
    path: str = scope["path"]
    shown = path if len(path) <= 200 else path[:200] + "..."
    log_event("forwarder.unrouted", logging.DEBUG, method=scope["method"], path=shown)
    await send_json_error(
        send,
        404,
        f"nothing is served at {shown!r}: no route sends {scope['method']} requests here",
        "invalid_request_error",
        "not_found",
    )
