"""Failover's final answers: the refusals and the caller's 503, 429 or 502.

A request Failover cannot route (400, 404), one the waiting room turns away (429,
503), one whose every tier failed (:func:`all_failed`), and a continuation left
without a tier (:func:`gave_up`). See docs/failover.md.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from .._responses import (
    send_final,
    send_json_error,
)
from .._types import Send
from ..request import (
    TRAIL_HEADER,
    AttemptRecord,
    TierRequest,
    format_trail,
)
from ..waiting import WaitRefused
from ..wire import error_format

__all__ = [
    "SAID_WHEN_SKIP",
    "Refusal",
    "all_failed",
    "attempt_json",
    "cooling",
    "gave_up",
    "refuse_route",
    "skipped",
    "turned_away",
]

_REFUSALS = frozenset({"http_429", "http_503"})
SAID_WHEN_SKIP = "cooling down for the backend's Retry-After"
"""The detail of a skip whose breaker a backend's Retry-After opened: the caller hears 429."""


class Refusal(NamedTuple):
    """A request Failover cannot route: the arguments of its JSON error answer."""

    status: int
    message: str
    type: str
    code: str


async def refuse_route(send: Send, refusal: Refusal, path: bytes) -> None:
    """Answer a request that has no route (400 or 404), in its path's wire format."""
    await send_json_error(send, *refusal, wire=error_format(path))


async def turned_away(send: Send, req: TierRequest, refused: WaitRefused) -> None:
    """The waiting room turned the request away: 429 or 503, with its Retry-After."""
    await send_json_error(
        send,
        refused.status,
        refused.message,
        "rate_limit_error" if refused.status == 429 else "server_error",
        refused.code,
        headers=[(b"retry-after", str(refused.retry_after).encode())],
        wire=req.wire,
    )


async def all_failed(req: TierRequest, send: Send, of: int) -> None:
    """No tier answered: the caller's 503, 429 or 502."""
    gone = skipped(req)
    trail = [(TRAIL_HEADER, format_trail(req.attempts))]
    records = req.attempts
    if len(gone) == of and not all(r.detail == SAID_WHEN_SKIP for r in records):
        soonest_s = min((s for s in gone.values() if s is not None), default=1.0)
        retry = max(1, math.ceil(soonest_s))
        await send_json_error(
            send,
            503,
            f"every backend for route {req.route!r} is cooling down; retry in {retry}s",
            "all_backends_open",
            "service_unavailable",
            headers=[*trail, (b"retry-after", str(retry).encode())],
            wire=req.wire,
            backends=[{"backend": b, "state": "open", "retry_in_s": s} for b, s in gone.items()],
        )
        return
    refused = [r for r in records if r.outcome in _REFUSALS or cooling(r)]
    if refused and all(r.outcome in ("http_429", "http_503", "skipped", "busy") for r in records):
        # Every tier said "not now": that is the caller's answer, not a bad gateway. A
        # tier still cooling down from its own Retry-After says it again: 429 stays 429
        # for the callers after the first.
        status = 429 if all(r.outcome == "http_429" or cooling(r) for r in records) else 503
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
            attempts=[attempt_json(r) for r in records],
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
        attempts=[attempt_json(r) for r in records],
    )


async def gave_up(req: TierRequest, send: Send) -> None:
    """No tier was left to continue on: end the stream with the original break."""
    cont = req.continuation
    assert cont is not None
    req.continuation = None
    message = {"type": "http.response.body", "body": cont.error, "more_body": False}
    await send_final(send, message, req)


def cooling(record: AttemptRecord) -> bool:
    """True for a skip whose breaker the backend's own Retry-After opened."""
    return record.outcome == "skipped" and record.detail == SAID_WHEN_SKIP


def skipped(req: TierRequest) -> dict[str, float | None]:
    """The backends whose breaker skipped them, with when each said to come back."""
    return {r.backend: r.retry_after for r in req.attempts if r.outcome == "skipped"}


def attempt_json(record: AttemptRecord) -> dict[str, Any]:
    item: dict[str, Any] = {"backend": record.backend, "outcome": record.outcome}
    if record.pool is not None:
        item["pool"] = record.pool
    if record.retry_after is not None:
        item["retry_after_s"] = round(record.retry_after, 1)
    if record.detail is not None:
        item["message"] = record.detail
    return item
