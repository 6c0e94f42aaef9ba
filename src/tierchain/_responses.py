"""Small helpers to answer a request ourselves, and to end one whose caller stopped reading."""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import math
import time
from typing import Any

from . import _json, formats
from ._types import Headers, Message, Send
from .errors import CallerStalled
from .request import TierRequest
from .telemetry import CALLERS_CUT, labelled, log_event


async def send_json_error(
    send: Send,
    status: int,
    message: str,
    type: str,
    code: str | None = None,
    *,
    headers: Headers | None = None,
    wire: str | None = None,
    **extra: Any,
) -> None:
    """Answer ``status`` with a JSON error body: OpenAI's shape, or ``wire``'s own
    (``WireFormat.error_object``; Ollama's ``{"error": "..."}`` on ``/api/*``)."""
    error = formats.of(wire).error_object(message, type, code, **extra)
    body = json.dumps(error, ensure_ascii=False).encode()
    all_headers: Headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(headers or ()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def header(headers: Headers, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower-case), or None."""
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


RETRY_AFTER_MAX = 900.0
"""The most seconds a ``Retry-After`` from outside is read as (the Breaker's default
``retry_after_cap``): a larger one, a number of 309 digits, an HTTP date years away, is
read as this, so no caller is ever told more and nothing waits or stores more."""


def retry_after(headers: Headers) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), or None.

    The one reader of an upstream's ``Retry-After``: clamped to ``0 ..``
    :data:`RETRY_AFTER_MAX` (an infinite one too), None when it is not a number or a
    date (``NaN`` included).
    """
    value = header(headers, b"retry-after")
    if value is None:
        return None
    text = value.decode("latin-1").strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, OverflowError):
            return None
        seconds = when.timestamp() - time.time()
    if math.isnan(seconds):
        return None
    return min(max(0.0, seconds), RETRY_AFTER_MAX)


def error_detail(body: bytes) -> str | None:
    """The message an upstream error body gives (OpenAI shape or plain text), shortened."""
    if not body:
        return None
    try:
        data = _json.loads(body)
    except (UnicodeDecodeError, ValueError):
        data = None
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            text = error["message"]
        elif isinstance(error, str):
            text = error
        elif isinstance(data.get("message"), str):
            text = data["message"]
        elif isinstance(data.get("detail"), str):
            text = data["detail"]
        else:
            text = body.decode("utf-8", "replace")
    else:
        text = body.decode("utf-8", "replace")
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:300] + "..."


async def send_final(send: Send, message: Message, req: TierRequest) -> None:
    """A last write to a caller whose response has started (an error event), bounded
    by the request's ``send_timeout`` (see :class:`FinalWrites`)."""
    async with FinalWrites(req):
        await send(message)


class FinalWrites:
    """``async with FinalWrites(req):`` the last writes to a caller, bounded by the
    request's ``send_timeout``: a caller that does not take them in time is cut
    (:class:`~tierchain.errors.CallerStalled`, counted and logged) rather than
    waited on."""

    __slots__ = ("bound", "req")

    def __init__(self, req: TierRequest) -> None:
        self.req = req
        self.bound = asyncio.timeout(req.send_timeout)

    async def __aenter__(self) -> None:
        await self.bound.__aenter__()

    async def __aexit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            await self.bound.__aexit__(kind, exc, tb)
        except TimeoutError:
            if not self.bound.expired():
                raise
            raise caller_cut(self.req, "final_write") from None


def caller_cut(req: TierRequest, where: str) -> CallerStalled:
    """Count and log a caller cut for not reading; the exception that ends its request.

    ``where``: what was waiting on it (``relay``, ``final_write``)."""
    attempt = req.attempt
    backend = attempt.backend.name if attempt is not None else ""
    labelled(CALLERS_CUT, req.route or "", backend).inc()
    log_event(
        "dispatch.caller_stalled",
        level=logging.WARNING,
        route=req.route,
        backend=backend or None,
        waiting=where,
        send_timeout_s=req.send_timeout,
    )
    return CallerStalled(
        f"the caller took no data for {req.send_timeout:g}s (send_timeout)",
    )
