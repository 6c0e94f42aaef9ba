"""Continuation: finish a broken answer on the next tier, in the caller's own stream.

When a committed stream breaks, stalls or is cut, the attempt (``attempt.py``, or a
continuing one's, ``continuing.py``) asks :func:`continue_stream` whether the next tier
may finish it: that sets up the request's :class:`Continuation`, or says what the caller
gets instead. The seam of the answer the caller has comes from :func:`seam`: the
request's wire format builds it (``WireFormat.seam``, in the format's own module of
:mod:`tierchain.formats`: its events parsed once, the next tier's request, its events
rewritten into the first tier's envelope, the stream's own end at the caller's limit).
What every format's seam shares (the repeat cut at the seam, the token limits,
:data:`INSTRUCTION`) is :mod:`tierchain.formats.seam`.

Nothing here does I/O: Failover drives it.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..formats import of
from ..formats.seam import INSTRUCTION, LIMIT_KEYS, Seam
from ..request import Attempt, TierRequest
from ..telemetry import CONTINUATIONS, labelled, log_event

__all__ = ["INSTRUCTION", "LIMIT_KEYS", "Continuation", "Seam", "continue_stream", "seam"]

_CONTINUE_MIN_LEFT = 1.0  # budget seconds below which a broken stream is not continued
# The seam's refusals that are no block in flight: a format, path or body with no
# continuation. Every other refusal names a block, delta or item that is not text (a tool
# call, an Anthropic ``thinking`` block and its ``thinking_delta``, a Responses item other
# than a message and its events): a tool call or other non-text block in flight.
_NO_SEAM = frozenset({"choices", "not_chat", "format"})


def continue_stream(
    continuable: Mapping[str, int],
    req: TierRequest,
    attempt: Attempt,
    wire: str | None,
    ndjson: bool,
    sent: list[bytes],
    error: bytes,
) -> bytes | None:
    """After a committed stream broke: set up its continuation on the next tier
    (None), or say what the caller gets instead: ``error``, or the answer's own end when
    the caller's token limit leaves nothing to ask for.

    Parses the events the caller has (``sent``) once, here, off the healthy path."""
    route = req.route or ""
    previous = req.continuation
    done = previous.done if previous is not None else 0
    origin = previous.origin if previous is not None else attempt.backend.name
    if previous is None:
        writers = [origin]
    else:  # the tier that broke in its turn wrote some of the answer, or none
        writers = [*previous.writers, *([attempt.backend.name] if previous.seam.spliced else [])]
    if (
        done >= continuable.get(route, 0)
        or attempt.n >= len(req.chain)
        or req.cancel_reason is not None
        or req.body is None
    ):
        req.continuation = None
        return error
    target = req.chain[attempt.n]
    to = target.pool or target.name  # (a pool's replica is picked when it starts)
    body = previous.body if previous is not None else req.body
    try:
        found = seam(wire, origin, b"".join(sent), ndjson=ndjson)
    except Exception as exc:  # events of a shape no format rule expects
        found = Seam(origin)
        found.ok, found.why = False, f"unparsed: {exc!r}"
    found.writers = writers
    why = _why_not(req, attempt, (target.wire_format or req.wire) != wire, found, body)
    if why == "length":
        # The caller's token limit is reached: the answer ends as the backend would have
        # ended it there, in its own format, never with the break's error.
        error = found.ending()
    if why:
        req.continuation = None
        labelled(CONTINUATIONS, route, origin, to, why).inc()
        log_event(
            "dispatch.continuation",
            level=20 if why == "length" else 30,
            route=route,
            outcome=why,
            detail=found.why or None,
            origin=origin,
            backend=to,
            written_by=",".join(writers) if why == "length" else None,
        )
        return error
    req.continuation = Continuation(
        found, error, done + 1, origin, sent, body, wire, ndjson, writers
    )
    req.emit("continuing", **{"from": origin}, backend=to, after_chars=len(found.text))
    log_event(
        "dispatch.continuing",
        route=route,
        after_chars=len(found.text),
        origin=origin,
        backend=to,
    )
    return None


def _why_not(
    req: TierRequest, attempt: Attempt, other_format: bool, found: Seam, body: bytes
) -> str:
    """Why the answer ``found`` cannot be continued on the next tier ("": it can)."""
    left = req.remaining()
    # At least a second of budget left (or half the reserve the watchdog kept, when
    # that is shorter: a stream it cut at the reserve's point has about the reserve).
    least = _CONTINUE_MIN_LEFT
    if attempt.reserve:
        least = min(least, attempt.reserve / 2)
    if left is not None and left < least:
        return "no_time"
    if other_format:
        return "unsupported"  # another wire format: the envelope could not be kept
    if not found.ok:
        unsupported = found.why in _NO_SEAM or found.why.startswith("unparsed")
        return "unsupported" if unsupported else "tool_calls"
    if found.request(body, prefill=False) is None:
        return "unsupported"  # not a JSON body with messages
    if found.left == 0:
        return "length"
    return ""


class Continuation:
    """A broken stream being finished on a later tier (``TierRequest.continuation``)."""

    __slots__ = ("body", "done", "error", "ndjson", "origin", "seam", "sent", "wire", "writers")

    def __init__(
        self,
        seam: Seam,
        error: bytes,
        done: int,
        origin: str,
        sent: list[bytes],
        body: bytes,
        wire: str | None,
        ndjson: bool,
        writers: list[str],
    ) -> None:
        self.seam = seam
        self.error = error  # the original break, in the caller's format
        self.done = done  # continuations started for this request
        self.origin = origin  # the backend whose answer is being finished
        self.sent = sent  # every event the caller has (kept by reference)
        self.body = body  # the caller's own request
        self.wire = wire
        self.ndjson = ndjson
        self.writers = writers  # the backends whose text the caller has, in order


def seam(wire: str | None, origin: str, sent: bytes, *, ndjson: bool) -> Seam:
    """The seam of an answer in ``wire`` whose events ``sent`` reached the caller from
    ``origin``; check :attr:`Seam.ok` before continuing it."""
    return of(wire).seam(origin, sent, ndjson=ndjson)
