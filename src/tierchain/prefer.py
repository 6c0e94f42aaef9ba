"""PreferBackend: let a caller (and an operator's pin) put one backend first.

Reorder, never filter. The named backend (or pool) moves to the front of this
request's chain and every other tier stays behind it in its order, so a preferred backend
that fails still falls back exactly as before. The layer registers a reorderer
on the per-request object; :class:`~tierchain.Failover` applies it once the
route is known and refuses any result that is not a permutation.

A header value is trimmed and bounded before it reaches a routing decision. An
empty, over-long, non-ASCII, control-character or list value, or a name that is
not in the route's chain, is ignored: the order stays as it was and the request
proceeds. A routing hint never fails a request that would otherwise have worked.

With a ``store``, an operator's pin (see :class:`~tierchain.Admin`) applies to
every request on its route first; the header of an individual request is
applied after it, so the header wins and the pinned backend comes second.

``allow(scope) -> bool`` decides who may steer: a request it refuses keeps its
chain order (pins still apply), as if it carried no header. A predicate that
raises refuses, and is logged as ``request.prefer_allow_failed``.

Every request carrying the header logs ``request.backend_preference`` (the
requested name, sanitised and truncated, and whether it applied), counts
``tierchain_backend_preference_total{applied}``, and sets the same on the
current span.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from opentelemetry import trace

from ._checks import duration
from ._types import ASGIApp, Receive, Scope, Send
from .backend import Backend
from .request import Preference, TierRequest
from .store import Store
from .telemetry import ATTR_ROUTE, BACKEND_PREFERENCE, log_event

__all__ = ["MAX_PREFERENCE_LENGTH", "PreferBackend"]

MAX_PREFERENCE_LENGTH = 64
"""The longest header value (after trimming) that is considered at all."""

ATTR_PREFERENCE_REQUESTED = "tierchain.preference.requested"
ATTR_PREFERENCE_APPLIED = "tierchain.preference.applied"
ATTR_PREFERENCE_REASON = "tierchain.preference.reason"
ATTR_PIN_BACKEND = "tierchain.pin.backend"

_HEADER_NAME = re.compile(rb"[A-Za-z0-9!#$%&'*+.^_`|~-]+")
_WHITESPACE = b" \t"


@dataclass(frozen=True, slots=True)
class _Preference:
    """What one request asked for: ``name`` when usable, else why not."""

    name: str | None
    shown: str
    reason: str


def sanitise(raw: bytes, limit: int = MAX_PREFERENCE_LENGTH) -> str:
    """``raw`` made safe for a log line: printable ASCII, others as ``?``, truncated."""
    text = "".join(chr(b) if 0x20 <= b < 0x7F else "?" for b in raw[: limit + 1])
    return text[:limit] + "..." if len(raw) > limit else text


def parse_preference(values: list[bytes]) -> _Preference:
    """Judge the header's raw values; only a single clean name is usable."""
    if len(values) > 1:
        return _Preference(None, sanitise(b",".join(values)), "list")
    raw = values[0].strip(_WHITESPACE)
    shown = sanitise(raw)
    if not raw:
        return _Preference(None, shown, "empty")
    if len(raw) > MAX_PREFERENCE_LENGTH:
        return _Preference(None, shown, "too_long")
    if any(b < 0x20 or b == 0x7F for b in raw):
        return _Preference(None, shown, "control_characters")
    if any(b >= 0x80 for b in raw):
        return _Preference(None, shown, "not_ascii")
    if b"," in raw:
        return _Preference(None, shown, "list")
    return _Preference(raw.decode("ascii"), shown, "ok")


def _to_front(chain: tuple[Backend, ...], name: str) -> tuple[Backend, ...] | None:
    """``chain`` with ``name`` moved to the front, or None when it is not there.

    ``name`` may name a pool: its replicas move to the front together (Failover
    then picks among them); a replica's own name moves its whole pool, that
    replica first."""
    for i, backend in enumerate(chain):
        if backend.name == name:
            return (backend, *chain[:i], *chain[i + 1 :])
    members = tuple(b for b in chain if b.pool == name)
    if members:
        return (*members, *(b for b in chain if b.pool != name))
    return None


class PreferBackend:
    """Move a caller's preferred backend (and an operator's pin) to the chain's front.

    ``header`` names the request header (default ``X-Prefer-Backend``).
    ``store``, when given, is where operator pins live (the same store the
    :class:`~tierchain.Admin` app and the breaker use); without one, only the
    header applies. ``pin_timeout`` bounds each pin lookup: a store that does
    not answer in time is treated as "no pin" rather than delaying the request.
    ``allow(scope) -> bool``, when given, decides whether this request may steer
    at all (default: every caller may); keep anonymous callers off a paid tier
    with it. PreferBackend sits outside :class:`~tierchain.Failover`.

    Options: [PreferBackend options](prefer.md#options).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        header: str = "X-Prefer-Backend",
        store: Store | None = None,
        pin_timeout: float | timedelta = 0.5,
        allow: Callable[[Scope], bool] | None = None,
    ) -> None:
        if not isinstance(header, str) or not _HEADER_NAME.fullmatch(header.encode()):
            raise ValueError(
                f"header must be an HTTP header name such as X-Prefer-Backend, got {header!r}"
            )
        pin_timeout = duration("pin_timeout", pin_timeout)
        self.app = app
        self.header = header
        self._header = header.lower().encode("ascii")
        self.store = store
        self.pin_timeout = float(pin_timeout)
        if allow is not None and not callable(allow):
            raise ValueError(f"allow must be a callable taking the ASGI scope, got {allow!r}")
        self.allow = allow
        self._warned_inside = False
        self._warned_unrouted = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = self._header
        if self.store is None:
            # Most requests state no preference: one pass over the names, no list made.
            size = len(header)
            for key, _ in scope["headers"]:
                if len(key) == size and key.lower() == header:  # (a lower() for a likely one)
                    break
            else:
                return await self.app(scope, receive, send)
        values = [v for k, v in scope["headers"] if k.lower() == header]
        return await self._prefer(scope, receive, send, values)

    async def _prefer(
        self, scope: Scope, receive: Receive, send: Send, values: list[bytes]
    ) -> None:
        """A request with a preference (or a pin store to ask): reorder its chain."""
        req = TierRequest.of(scope)
        if req.in_chain:
            self._warn_inside()
            return await self.app(scope, receive, send)
        preference = parse_preference(values) if values else None
        if preference is not None and preference.name is not None and not self._allowed(scope):
            preference = _Preference(None, preference.shown, "not_allowed")
        if preference is not None and preference.name is None:
            self._report(req, preference, applied=False, route=None)
            if self.store is None:
                return await self.app(scope, receive, send)
            preference = None
        seen = False

        async def reorder(route: str, chain: tuple[Backend, ...]) -> tuple[Backend, ...]:
            nonlocal seen
            seen = True
            if self.store is not None:
                pinned = await self._pin(route)
                if pinned is not None:
                    moved = _to_front(chain, pinned)
                    if moved is not None:
                        chain = moved
                        req.pin = pinned
                        trace.get_current_span().set_attribute(ATTR_PIN_BACKEND, pinned)
            if preference is not None and preference.name is not None:
                moved = _to_front(chain, preference.name)
                if moved is not None:
                    chain = moved
                    self._report(req, preference, applied=True, route=route)
                else:
                    not_there = _Preference(None, preference.shown, "not_in_chain")
                    self._report(req, not_there, applied=False, route=route)
            return chain

        req.reorderers.append(reorder)
        try:
            await self.app(scope, receive, send)
        finally:
            if not seen and preference is not None:
                self._report(
                    req,
                    _Preference(None, preference.shown, "not_routed"),
                    applied=False,
                    route=None,
                )
                self._warn_unrouted()

    def _allowed(self, scope: Scope) -> bool:
        if self.allow is None:
            return True
        try:
            return bool(self.allow(scope))
        except Exception as exc:  # a broken predicate refuses; it never fails a request
            log_event("request.prefer_allow_failed", logging.WARNING, error=repr(exc))
            return False

    async def _pin(self, route: str) -> str | None:
        assert self.store is not None
        try:
            async with asyncio.timeout(self.pin_timeout):
                return await self.store.get_pin(route)
        except Exception as exc:  # a store outage must not fail a request
            log_event("request.pin_lookup_failed", logging.WARNING, route=route, error=repr(exc))
            return None

    def _report(
        self, req: TierRequest, preference: _Preference, *, applied: bool, route: str | None
    ) -> None:
        reason = "applied" if applied else preference.reason
        req.preference = Preference(preference.shown, applied, reason)
        BACKEND_PREFERENCE.labels("true" if applied else "false").inc()
        fields: dict[str, str | bool] = {
            "requested": preference.shown,
            "applied": applied,
            "reason": reason,
        }
        if route is not None:
            fields["route"] = route
        log_event("request.backend_preference", logging.INFO, **fields)
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attribute(ATTR_PREFERENCE_REQUESTED, preference.shown)
            span.set_attribute(ATTR_PREFERENCE_APPLIED, applied)
            span.set_attribute(ATTR_PREFERENCE_REASON, reason)
            if route is not None:
                span.set_attribute(ATTR_ROUTE, route)
            span.add_event("request.backend_preference", fields)

    def _warn_inside(self) -> None:
        if not self._warned_inside:
            self._warned_inside = True
            log_event(
                "prefer.misplaced",
                logging.ERROR,
                message="PreferBackend runs inside Failover, where the chain is already fixed: "
                "add it outside Failover (before it in the stack) so that it can reorder.",
            )

    def _warn_unrouted(self) -> None:
        if not self._warned_unrouted:
            self._warned_unrouted = True
            log_event(
                "prefer.not_routed",
                logging.WARNING,
                message=f"a request carried {self.header} but no Failover routed it: if that "
                "request should have been routed, put Failover(app, routes=...) inside "
                "PreferBackend.",
            )
