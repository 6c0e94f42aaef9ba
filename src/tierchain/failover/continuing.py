"""The attempt that finishes a broken answer on the next tier: its responder, a
:class:`Continuing`, whose whole events are spliced into the caller's stream in the
first tier's envelope. Whether a break is continued, and the :class:`Continuation` it
sets up, is :mod:`tierchain.failover.continuation`'s. See docs/failover.md.
"""

from __future__ import annotations

from collections.abc import Awaitable

from opentelemetry.trace import INVALID_SPAN

from .._disconnect import DisconnectGuard
from .._responses import (
    error_detail,
    retry_after,
)
from .._types import Message, Send
from ..errors import (
    AttemptError,
    CallerStalled,
    RetryableStatus,
    StreamError,
)
from ..observer import nothing_sent
from ..prefill import Prefill
from ..request import (
    Attempt,
    TierRequest,
)
from ..telemetry import (
    ATTR_AFTER_CHARS,
    ATTR_CONTINUES,
    ATTR_WRITTEN_BY,
    CONTINUATIONS,
    labelled,
    log_event,
)
from .attempt import Owner, Responder
from .continuation import continue_stream
from .plan import named, record

__all__ = ["Continuing"]


class Continuing(Responder):
    """The ``send`` of an attempt that finishes a broken answer: nothing of its head
    reaches the caller; its whole events are spliced into the caller's stream
    (:meth:`~tierchain.formats.seam.Seam.splice`). Any failure before its first event
    ends the stream with the original break; a 400 is the backend refusing the
    continuation (``prefill_rejected``), never the caller's error."""

    __slots__ = ("continuation", "prefill")

    def __init__(
        self, owner: Owner, req: TierRequest, attempt: Attempt, send: Send, guard: DisconnectGuard
    ) -> None:
        super().__init__(owner, req, attempt, send, guard)
        cont = req.continuation
        assert cont is not None
        cont.seam.writers = [*cont.writers, attempt.backend.name]
        span = self.span
        if span is not INVALID_SPAN:
            span.set_attribute(ATTR_CONTINUES, cont.origin)
            span.set_attribute(ATTR_AFTER_CHARS, len(cont.seam.text))
        self.continuation = cont
        # The prefill asked for (its request is made by prepare, when the attempt starts).
        self.prefill: Prefill | None = None

    async def prepare(self) -> None:
        """The request: the caller's, with the partial answer as a prefill where the
        backend takes one (:class:`~tierchain.prefill.Prefills`), else asked in words."""
        req, backend = self.req, self.attempt.backend
        cont = self.continuation
        left = req.remaining()
        found = await self._failover.prefills.for_backend(
            backend,
            backend.wire_format or req.wire,
            limit=None if left is None else left / 4,  # (the most of what is left)
        )
        self.prefill = found
        req.body = cont.seam.request(cont.body, prefill=found.takes, adds=found.adds)

    def _refuses(self, status: int) -> bool:
        # Any answer but a success in the stream's own framing: the caller never sees it.
        observer = self.observer
        same = observer.ndjson if self.continuation.ndjson else observer.sse
        return status >= 300 or not same

    def _other(self, message: Message) -> Awaitable[None]:
        return nothing_sent()  # nothing of its own reaches the caller but its events

    def send(self, message: Message) -> Awaitable[None]:
        unsent = self._unsent(message)  # the head, a refusal: as every attempt's
        if unsent is not None:
            return unsent
        observer = self.observer
        chunk: bytes = message.get("body", b"")
        more = bool(message.get("more_body", False))
        out = self._observed(chunk)
        if out is None:
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
            self.req.emit("generating", **named(self.attempt.backend))
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
        prefill = self.prefill
        if error is None:
            req.continuation = None
            if prefill is not None:
                await failover.prefills.recorded(attempt.backend, prefill, taken=True)
            record(req, attempt, "ok")
            labelled(CONTINUATIONS, route, cont.origin, target, "ok").inc()
            written_by = cont.seam.writers
            if self.span is not INVALID_SPAN:
                self.span.set_attribute(ATTR_WRITTEN_BY, written_by)
            log_event(
                "dispatch.continuation",
                route=route,
                outcome="ok",
                after_chars=len(cont.seam.text),
                added_chars=len(cont.seam.sent_text),
                origin=cont.origin,
                backend=target,
                written_by=",".join(written_by),
            )
            return True
        outcome = self.outcome = error.reason if isinstance(error, AttemptError) else "error"
        if outcome == "prefill_rejected" and prefill is not None:
            await failover.prefills.recorded(attempt.backend, prefill, taken=False)
        record(req, attempt, outcome)
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
        then = continue_stream(
            failover.continuable, req, attempt, cont.wire, cont.ndjson, cont.sent, shown
        )
        if then is None:
            return False  # one more continuation, on the tier after this one
        shown = then
        self._guard.done = True
        await self._to_caller({"type": "http.response.body", "body": shown, "more_body": False})
        return True
