"""Failover's call of the inner app for one attempt (its ``receive`` is
:class:`tierchain._disconnect.Replay`):
its span made current inside (:func:`current`, :func:`attempt_span`), and its own abort
told from every other cancellation (:func:`own_abort`). See docs/failover.md.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from opentelemetry.trace import INVALID_SPAN, Span, use_span

from ..request import (
    Attempt,
    TierRequest,
)
from ..telemetry import (
    ATTR_ATTEMPT_N,
    ATTR_ATTEMPT_OF,
    ATTR_BACKEND,
    ATTR_POOL,
    ATTR_REGIME,
    ATTR_RETRY,
    ATTR_ROUTE,
    start_span,
)

__all__ = ["attempt_span", "current", "own_abort"]


def current(span: Span) -> AbstractContextManager[object]:
    """``span`` made the current span, when it records (else nothing to do)."""
    if not span.is_recording():
        return nullcontext()
    return use_span(span, record_exception=False, set_status_on_exception=False)


def attempt_span(req: TierRequest, attempt: Attempt) -> Span:
    if not req.traced:
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


def own_abort(req: TierRequest) -> bool:
    """True when the running task's cancellation was the attempt's own abort (now undone)."""
    if not req.aborted:
        return False
    req.aborted = False
    # Only our own cancellation: a pending one (the caller left, the budget) goes on.
    return req.interruption is not None and req.interruption.ours()
