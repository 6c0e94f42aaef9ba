"""What the watchdog says of an attempt it cut, and how the attempt ends.

Once a :class:`~tierchain.watch.Watch` has fired and its interruption landed,
:func:`verdict` tells why: a stalled stream (``StreamError``), a starved one
(``BackendSaturated`` with ``why="slow_decode"``), a committed stream cut at the
reserve's point for the next tier (``BackendUnavailable``, the gateway's doing), or no
first chunk in time (``BackendSaturated``); each with its log line, span event and
metric, the backend marked suspect for the callers after. Alone (no Failover) the
watchdog answers the caller itself: a 504, or the stream's own error event.
"""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry import trace

from ._responses import send_json_error
from ._runtime import clock
from ._types import Send
from .decode import SPANS, DecodeWatch
from .errors import BackendSaturated, BackendUnavailable, StreamError
from .telemetry import ATTR_BACKEND, BACKEND_SATURATED, RESERVE_ENDED, labelled, log_event
from .watch import Watch

__all__ = ["verdict"]


async def verdict(watch: Watch, send: Send) -> None:
    """Our cancellation landed: say why, as an exception or (alone) an answer."""
    if watch.fired == "stalled":
        watch.suspect("stalled")
        message = f"{watch.who} sent no data event for {watch.stall:g}s"
        if watch.own and watch.attempt is None and watch.observer.framed:
            watch.observer.drop_pending()
            await send(
                {
                    "type": "http.response.body",
                    "body": watch.observer.error_bytes(message, "upstream_error", "stalled") or b"",
                    "more_body": False,
                }
            )
            return
        raise StreamError(message, reason="stalled")
    if watch.fired == "slow_decode" and watch.decoding is not None:
        _starved(watch, watch.decoding)  # raises
    if watch.fired == "reserve" and watch.answered() and watch.attempt is not None:
        # A committed stream cut at the reserve's point for the next tier to finish:
        # the budget's doing, not the backend's (no breaker counts it).
        raise BackendUnavailable(
            f"backend {watch.backend!r} was still streaming {watch.reserve:g}s before the "
            "budget ends (the reserve kept for the next tier)",
            reason="reserve",
            gateway_fault=True,
        )
    if not watch.answered():
        await _saturated(watch, send)


def _starved(watch: Watch, decode: DecodeWatch) -> None:
    """Say that a committed stream was starved, and raise for Failover to continue it
    on the next tier (a saturation: the Breaker counts it as one)."""
    backend = watch.backend or ""
    rate, limit = round(decode.rate, 2), round(decode.limit, 2)
    labelled(BACKEND_SATURATED, watch.route, backend).inc()
    log_event(
        "dispatch.backend_starved",
        level=logging.WARNING,
        route=watch.route,
        backend=backend,
        tokens_per_s=rate,
        limit_tokens_per_s=limit,
        learned=decode.learned,
        span_s=decode.span,
    )
    trace.get_current_span().add_event(
        "tierchain.backend_starved", {ATTR_BACKEND: backend, "tokens_per_s": rate}
    )
    if watch.req is not None and watch.attempt is not None:
        named: dict[str, Any] = {"backend": backend}
        if watch.attempt.backend.pool is not None:
            named["pool"] = watch.attempt.backend.pool
        watch.req.emit(
            "backend_starved",
            **named,
            reason="slow_decode",
            tokens_per_s=rate,
            limit_tokens_per_s=limit,
            failing_over=True,
        )
    watch.suspect("slow_decode")
    raise BackendSaturated(
        f"backend {backend!r} wrote {rate:g} tokens/s over {SPANS} spans of "
        f"{decode.span:g}s, under its limit of {limit:g} (starved)",
        waited=clock.now() - watch.start,
        why="slow_decode",
    )


async def _saturated(watch: Watch, send: Send) -> None:
    waited = clock.now() - watch.start
    reason = watch.fired or "no_first_chunk"
    backend = watch.backend or ""
    labelled(BACKEND_SATURATED, watch.route, backend).inc()
    if reason == "reserve":
        labelled(RESERVE_ENDED, watch.route, backend).inc()
    verdict = watch.attempt.verdict if watch.attempt is not None else None
    log_event(
        "dispatch.backend_saturated",
        level=logging.WARNING,
        route=watch.route,
        backend=backend,
        waited_s=round(waited, 3),
        reason=reason,
        failing_over=not watch.last,
        n=watch.attempt.n if watch.attempt is not None else None,
        of=watch.attempt.of if watch.attempt is not None else None,
        reserve_s=round(watch.reserve, 3) if watch.reserve else None,
        verdict=verdict,
    )
    span = trace.get_current_span()
    span.add_event(
        "tierchain.backend_saturated",
        {ATTR_BACKEND: backend, "reason": reason, "waited_s": round(waited, 3)},
    )
    span.set_attribute("tierchain.saturated_reason", reason)
    if verdict is not None:
        span.set_attribute("tierchain.verdict", verdict)
    learned = watch.watchdog.learned
    if learned is not None and watch.backend is not None and reason != "reserve":
        learned.saturated(watch.backend, watch.req.body if watch.req else None, watch.learned)
    watch.suspect(reason)
    what = "no first chunk" if watch.observer.first_data_at is None else "no whole answer"
    message = f"{watch.who} produced {what} in {waited:.1f}s ({reason})"
    if watch.attempt is not None:
        raise BackendSaturated(message, waited=waited, why=reason)
    # Alone (no Failover): only the ceiling ends an attempt; answer it ourselves.
    observer = watch.observer
    if observer.status is None:
        await send_json_error(send, 504, message, "backend_saturated", reason)
    elif observer.framed:
        observer.drop_pending()
        await send(
            {
                "type": "http.response.body",
                "body": observer.error_bytes(message, "backend_saturated", reason) or b"",
                "more_body": False,
            }
        )
    else:
        raise BackendSaturated(message, waited=waited, why=reason)
