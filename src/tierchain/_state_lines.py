"""A state event as the SSE comment line Heartbeats writes, counted and traced.

The same few state lines repeat for every request, so each one's bytes and
counter are found with one lookup (at most ``_KNOWN_MAX`` kept). The last event of
each state is kept too: an event equal to it (with its keys in the same order) is
known without a tuple of its items to build and hash.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.trace import INVALID_SPAN, Span

from .request import StateEvent
from .sse import comment_line
from .telemetry import STREAM_HEARTBEATS, labelled

__all__ = ["state_line", "state_lines"]

_KNOWN: dict[tuple[tuple[str, Any], ...], tuple[bytes, str, Any]] = {}
_KNOWN_MAX = 4096
# state -> (the last such event, a copy; its keys in order; what it is)
_LAST: dict[Any, tuple[StateEvent, tuple[str, ...], tuple[bytes, str, Any]]] = {}


def state_line(event: StateEvent, span: Span, keepalive: bool) -> bytes:
    """``event``'s comment line; counted in ``tierchain_stream_heartbeats_total`` and,
    while ``span`` records, a ``stream.heartbeat`` event on it."""
    line, state, counted = _known(event)
    counted.inc()
    if span is not INVALID_SPAN and span.is_recording():  # (none current: never recording)
        span.add_event("stream.heartbeat", {"state": state, "keepalive": keepalive})
    return line


def state_lines(events: list[StateEvent], span: Span) -> bytes:
    """Every queued event's line, in order, as :func:`state_line` (not keepalives): one
    call and one ``is_recording`` for the batch (a request queues two or three)."""
    recording = span is not INVALID_SPAN and span.is_recording()  # (as in state_line)
    out = b""
    for event in events:
        line, state, counted = _known(event)
        counted.inc()
        if recording:
            span.add_event("stream.heartbeat", {"state": state, "keepalive": False})
        out += line
    return out


def _known(event: StateEvent) -> tuple[bytes, str, Any]:
    """``event``'s line, state and counter: the last event of its state, a kept one, or
    encoded now."""
    try:
        last = _LAST.get(event.get("state"))
        if last is not None and last[0] == event and tuple(event) == last[1]:
            return last[2]
        known = _KNOWN.get(tuple(event.items()))
    except TypeError:  # a value that cannot be a key
        known = None
    return _new(event) if known is None else known


def _new(event: StateEvent) -> tuple[bytes, str, Any]:
    state = str(event.get("state"))
    try:
        line = comment_line(event)
    except (TypeError, ValueError):  # a field that is not JSON: say the state only
        line = comment_line({"state": state})
    known = (line, state, labelled(STREAM_HEARTBEATS, state))
    try:
        key = tuple(event.items())
        hash(key)
    except TypeError:
        return known  # not kept: encoded each time
    if len(_KNOWN) >= _KNOWN_MAX:
        _KNOWN.clear()
        _LAST.clear()
    _KNOWN[key] = known
    _LAST[event.get("state")] = (dict(event), tuple(event), known)
    return known
