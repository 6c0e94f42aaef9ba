"""Shed: past a number of requests in flight, answer 503 at once instead of slowing every stream.

A gateway process has a capacity: one event loop, so many streams it can keep
moving. Past it, every request slows down together (admissions take longer,
keepalives and connect timeouts run late) until healthy backends start to look
broken. ``Shed`` counts the HTTP requests in flight in this process and, when
``max_concurrent`` are already in flight, answers a new one ``503`` with a
``Retry-After`` header and an OpenAI-style JSON error body (type
``overloaded``, code ``gateway_overloaded``), without reading its body or
passing it on. Clients that honour ``Retry-After`` (the OpenAI SDKs do) come
back; a load balancer sends them elsewhere.

A request that carries a body counts from the moment its body is in (its last
``http.request`` message reached the app), not from its arrival: a caller that
drips its body a byte at a time holds no place while it drips, so four slow
uploads cannot take four places and shed everyone else. A request announcing
no body (no ``content-length`` above 0, no ``transfer-encoding``) counts at
once. The decision to shed is taken at arrival, against the requests counted
then: a request is never answered 503 after its body was read (the app may
already be answering it). How long a body may take is bounded where it is
read: Failover's (or a lone Forwarder's) ``body_timeout`` answers 408.

It belongs outermost, in front of Heartbeats, so that a shed request costs
nothing but the answer. ``max_concurrent=None`` (the default) sheds nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import timedelta

from ._checks import count, duration
from ._responses import send_json_error
from ._types import ASGIApp, Message, Receive, Scope, Send
from .telemetry import SHED_REQUESTS
from .wire import error_format

__all__ = ["Shed"]


class Shed:
    """Answer ``503`` + ``Retry-After`` once ``max_concurrent`` requests are in flight.

    ``max_concurrent``: HTTP requests this instance lets through at once (None:
    no limit). ``retry_after``: seconds put in the ``Retry-After`` header
    (rounded up to a whole second). Only ``http`` scopes count; lifespan and
    websocket scopes pass through.

    Options: [Shed options](shed.md#options).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_concurrent: int | None = None,
        retry_after: float | timedelta = 1.0,
    ) -> None:
        max_concurrent = count("max_concurrent", max_concurrent, allow_none=True)
        retry_after = duration("retry_after", retry_after, allow_zero=True)
        self.app = app
        self.max_concurrent = max_concurrent
        self.retry_after = retry_after
        self._retry_header = str(math.ceil(retry_after)).encode()
        self.in_flight = 0
        """HTTP requests in flight through this instance now."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.max_concurrent is None:
            return await self.app(scope, receive, send)
        if self.in_flight >= self.max_concurrent:
            SHED_REQUESTS.inc()
            await send_json_error(
                send,
                503,
                f"the gateway is at capacity ({self.max_concurrent} requests in flight); "
                f"retry in {self._retry_header.decode()}s",
                "overloaded",
                "gateway_overloaded",
                headers=[(b"retry-after", self._retry_header)],
                wire=error_format(scope.get("path") or ""),
            )
            return
        if not _has_body(scope.get("headers", ())):
            self.in_flight += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.in_flight -= 1
            return
        counted = _CountOnceIn(self, receive)
        try:
            await self.app(scope, counted, send)
        finally:
            if counted.counted:
                self.in_flight -= 1


def _has_body(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    for key, value in headers:
        if key == b"transfer-encoding" or (key == b"content-length" and value.strip() != b"0"):
            return True
    return False


class _CountOnceIn:
    """The request's ``receive``: counts the request in flight once its body is in."""

    __slots__ = ("counted", "receive", "shed")

    def __init__(self, shed: Shed, receive: Receive) -> None:
        self.shed = shed
        self.receive = receive
        self.counted = False

    async def __call__(self) -> Message:
        message = await self.receive()
        if (
            not self.counted
            and message["type"] == "http.request"
            and not message.get("more_body", False)
        ):
            self.counted = True
            self.shed.in_flight += 1
        return message
