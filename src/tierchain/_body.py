"""Buffering the request body once so every attempt can replay it whole.

One helper for Failover and the standalone Forwarder alike
(:func:`read_or_refuse`): at most ``limit`` bytes (413 beyond, a declared
``content-length`` refused before reading), and the whole body within
``within`` seconds of the first read (408 after, and the connection closed:
a caller dripping a byte at a time holds nothing past it, nothing was sent to a
backend, and what was read is dropped).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import timedelta
from types import CoroutineType

from ._checks import duration
from ._head import refuse_request
from ._runtime import deadlines
from ._runtime.eager import run_until_wait
from ._runtime.interrupt import Interruption
from ._types import Message, Receive, Scope, Send
from .errors import BodyTooLarge

DEFAULT_BODY_TIMEOUT = 60.0
"""nginx's ``client_body_timeout``; here for the whole body, not between two reads."""


class CallerGone(Exception):
    """The caller disconnected before the request body was complete."""


class BodyTimeout(Exception):
    """The request body did not arrive whole in time."""


def timeout_option(name: str, value: float | timedelta | None) -> float | None:
    """The option ``name``'s ``value`` checked: seconds > 0, or None (no deadline).

    The caller-facing deadlines (``body_timeout``, ``send_timeout``), checked by the
    package's one duration check (:func:`tierchain._checks.duration`).
    """
    return duration(name, value, allow_none=True)


async def read_body(
    scope: Scope, receive: Receive, limit: int, within: float | None = None
) -> bytes:
    """Read the whole request body, refusing more than ``limit`` bytes.

    A declared ``content-length`` over the limit is refused before reading.
    With ``within``, the body must be whole within that many seconds
    (:class:`BodyTimeout` otherwise).
    """
    begun = _begin(scope, receive, limit, within)
    if type(begun) is bytes:
        return begun
    assert isinstance(begun, tuple)
    return await _rest(receive, limit, within, *begun)


def _begin(
    scope: Scope, receive: Receive, limit: int, within: float | None
) -> bytes | tuple[Awaitable[Message], Message | None]:
    """The reading's first step, in the caller's step: the whole body when the first
    message holds it (the usual case, no coroutine of :func:`_rest`'s), else what to
    go on from: the first read (still to await) or its message."""
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                declared = -1
            if declared > limit:
                raise BodyTooLarge(limit)
            break
    message: Message | None = None
    first: Awaitable[Message] = receive()
    if within is not None and type(first) is CoroutineType:
        # A server most often holds the body already (a small one comes with the head):
        # its first message is taken at once, and the deadline is armed only when the
        # reading must wait or go on, in this same step (so it falls due as it did).
        at_once, result = run_until_wait(first)
        if not at_once:
            first = result
        else:
            message = result
            if message["type"] == "http.request" and not message.get("more_body", False):
                chunk: bytes = message.get("body", b"")  # the whole body, in one message
                if len(chunk) > limit:
                    raise BodyTooLarge(limit)
                return chunk or b""
    return first, message


async def _rest(
    receive: Receive,
    limit: int,
    within: float | None,
    first: Awaitable[Message],
    message: Message | None,
) -> bytes:
    """The reading after :func:`_begin`, when the first message did not hold it all."""
    late: Interruption | None = None
    entry: deadlines.Deadline | None = None
    if within is not None:
        # On the shared loop timer (tierchain._runtime.deadlines), not asyncio.timeout: the
        # deadline almost never fires, and an asyncio timer per request costs more
        # than the rest of the body's reading.
        late = Interruption.on()
        entry = deadlines.schedule(within, late.interrupt)
    parts: list[bytes] = []
    size = 0
    try:
        if message is None:
            message = await first
        while True:
            kind = message["type"]
            if kind == "http.disconnect":
                raise CallerGone
            if kind == "http.request":
                chunk: bytes = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > limit:
                        raise BodyTooLarge(limit)
                    parts.append(chunk)
                if not message.get("more_body", False):
                    return parts[0] if len(parts) == 1 else b"".join(parts)
            message = await receive()
    except asyncio.CancelledError:
        if late is None or not late.ours():
            raise
        raise BodyTimeout from None
    finally:
        if entry is not None:
            deadlines.cancel(entry)


async def read_or_refuse(
    scope: Scope, receive: Receive, send: Send, limit: int, within: float | None
) -> bytes | None:
    """The whole body; or None, once the caller is answered 413 or 408 (or has gone)."""
    try:
        begun = _begin(scope, receive, limit, within)
        if type(begun) is bytes:
            return begun  # the usual case: a coroutine less than read_body
        assert isinstance(begun, tuple)
        return await _rest(receive, limit, within, *begun)
    except BodyTooLarge as exc:
        await refuse_request(
            scope, send, 413, str(exc), "body_too_large", type="request_too_large", limit=exc.limit
        )
    except BodyTimeout:
        await refuse_request(
            scope,
            send,
            408,
            f"the request body did not arrive within {within:g}s",
            "body_timeout",
        )
    except CallerGone:
        pass
    return None


def replayed(body: bytes, receive: Receive) -> Receive:
    """The request's ``receive`` once its body was read here: the body, then ``receive``."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
