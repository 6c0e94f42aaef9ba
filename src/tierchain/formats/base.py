"""The interface of a wire format: :class:`WireFormat`, and what its subclasses share.

A wire format is one protocol a request speaks (OpenAI chat, Anthropic Messages,
OpenAI Responses, Ollama's NDJSON, plain). Each is one subclass of
:class:`WireFormat` in a module of its own in this package, and one object of it
in :data:`tierchain.formats.TABLE`; the layers pick the object once per request
(``formats.of(wire)``) and ask it, never branching on the format's name. As
httpx's transports, the base class is small and its contract is written here:

- recognition: :attr:`~WireFormat.paths`, the request path endings that speak it
  (the first format of the table whose ending matches wins; none: OpenAI chat),
  and :attr:`~WireFormat.error_prefix`, a path prefix whose errors the gateway
  answers in this format's shape even where the path speaks no format;
- framing: :attr:`~WireFormat.lines`, its streams are NDJSON lines, not SSE
  events; :attr:`~WireFormat.comments`, whether heartbeat lines (SSE comments)
  may go into its streams;
- progress: :attr:`~WireFormat.opening` and :meth:`~WireFormat.no_progress`,
  events that open an answer without carrying any of it;
- completeness: :meth:`~WireFormat.stream_end` (the terminator a backend's
  ``stream_end`` names, as the observer keeps it), :meth:`~WireFormat.judge`
  (at the end of an event stream: did its last data event carry the terminator),
  :meth:`~WireFormat.whole` (is it complete), :meth:`~WireFormat.line_ends` and
  :attr:`~WireFormat.needs_done_line` (the same for NDJSON lines);
- errors: :meth:`~WireFormat.error_bytes` (an error written after the response
  began, so the format's own SDK raises it), :meth:`~WireFormat.error_object`
  (a whole error answer's JSON body), :attr:`~WireFormat.error_passes` (an
  upstream's own OpenAI-shaped error object may pass as it came);
- usage: :meth:`~WireFormat.usage`, the tokens one JSON object of the format reports;
- continuation: :meth:`~WireFormat.seam` (a :class:`~tierchain.formats.seam.Seam`
  for a broken answer, refused when the format has none), :attr:`~WireFormat.prefill`
  (does a server continue a trailing assistant message), :meth:`~WireFormat.check_request`
  (the gateway's own one-token request in this format).

Every default here is OpenAI chat's rule (the format of any path no other claims);
a subclass overrides only where its format differs.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .. import _json
from ..masking import mask_text
from ..sse import data_values, event_names
from .seam import Seam, dump

__all__ = [
    "NDJSON",
    "OPENAI_END",
    "SSE",
    "WireFormat",
    "count",
    "has_finish_reason",
    "kind_of",
    "opening_only",
    "refused",
]

SSE = 1
"""Framing: ``text/event-stream`` (events end with a blank line)."""
NDJSON = 2
"""Framing: ``application/x-ndjson`` (one JSON object per line)."""

OPENAI_END = b"openai"
"""The stream end ``stream_end="openai"`` names (as the observer keeps it): ``data:
[DONE]``, or a ``finish_reason`` in one of the last two data events before a clean end."""

_DONE = b"[DONE]"
_FINISH_KEY = b'"finish_reason"'
_DONE_EVENT = b"data: [DONE]\n\n"


def refused(origin: str) -> Seam:
    """A seam that cannot be continued (a format or framing without a continuation)."""
    seam = Seam(origin)
    seam._refuse("format")
    return seam


class WireFormat:
    """One wire format: see the module docstring for the contract. Stateless: one object
    per format serves every request."""

    name: ClassVar[str] = ""
    """The name ``wire_format=`` takes, and the key of the table."""
    paths: ClassVar[tuple[bytes, ...]] = ()
    """Request path endings (after a trailing ``/`` is dropped) that speak this format."""
    error_prefix: ClassVar[bytes | None] = None
    """A path prefix on which the gateway's own errors take this format's shape."""
    lines: ClassVar[bool] = False
    """Its streams are NDJSON lines (its usage is on its last line; no terminator event)."""
    comments: ClassVar[bool] = True
    """Heartbeat lines (SSE comments) may go into its streams."""
    opening: ClassVar[frozenset[bytes]] = frozenset()
    """Event names that open an answer (or keep the connection busy) without carrying any
    of it: a server sends them at once, before its queue or prefill, so not progress."""
    needs_done_line: ClassVar[bool] = False
    """An NDJSON stream of this format is complete only at its done line."""
    error_passes: ClassVar[bool] = True
    """An upstream's OpenAI-shaped ``{"error": {...}}`` may reach the caller as it came."""
    prefill: ClassVar[str] = "never"
    """Does a server continue a trailing assistant message: ``native`` (the format's own
    rule), ``ask`` (it depends on the server: ask it), ``never``."""

    def __repr__(self) -> str:
        return f"<wire format {self.name}>"

    # -- completeness -----------------------------------------------------------------

    def stream_end(self, configured: str | None) -> bytes | None:
        """The terminator a backend's ``stream_end`` names, as the observer keeps it:
        :data:`OPENAI_END`, a data value's bytes, or None (any clean end)."""
        if configured == "openai":
            return OPENAI_END
        return None if configured is None else configured.encode()

    def no_progress(self, events: bytes, started: bool) -> bool:
        """True when every event in ``events`` (whole events with data) only opens the
        answer; ``started``: progress was already seen. Asked only when :attr:`opening`
        is not empty."""
        return False

    def judge(self, previous: bytes, last: bytes, end: bytes | None) -> tuple[bool, bool]:
        """At the end of an event stream, from its last two data chunks: (did the last
        data event carry the terminator, was a ``finish_reason`` seen). ``end``: what
        :meth:`stream_end` returned."""
        if end is None:
            return False, False
        if end == OPENAI_END and (last == _DONE_EVENT or last.endswith(b"\n\n" + _DONE_EVENT)):
            return True, False  # the usual end, as its own event: nothing to parse
        values = data_values(last)
        if len(values) < 2:
            values = data_values(previous) + values
        if not values:
            return False, False
        if end == OPENAI_END:
            # A finish_reason, perhaps followed by a usage chunk, then a clean end.
            return values[-1] == _DONE, any(has_finish_reason(v) for v in values[-2:])
        return values[-1] == end, False

    def whole(self, terminated: bool, finish_seen: bool, end: bytes | None) -> bool:
        """Is an event stream that ended cleanly after data complete?"""
        return end is None or terminated or (end == OPENAI_END and finish_seen)

    def line_ends(self, lines: bytes) -> bool:
        """NDJSON: is the last of ``lines`` the stream's terminator?"""
        return False

    # -- errors -----------------------------------------------------------------------

    def error_bytes(self, framing: int, message: str, type: str, code: str | None = None) -> bytes:
        """An error written after the response began (``framing``: :data:`SSE` or
        :data:`NDJSON`, the response's own), so that the format's own SDK raises it. On
        NDJSON, any format's error is ``{"error": "..."}`` and a newline: the ``ollama``
        client raises ``ResponseError`` for a line with an ``error`` (ollama/_client.py)."""
        if "://" in message:
            message = mask_text(message)
        if framing == NDJSON:
            return dump({"error": message}) + b"\n"
        return self.error_event(message, type, code)

    def error_event(self, message: str, type: str, code: str | None) -> bytes:
        """The SSE error event (``message`` already masked): OpenAI's ``data: {"error":
        {"message","type","code"}}``, which the ``openai`` SDK raises as ``APIError``."""
        error = {"error": {"message": message, "type": type, "code": code}}
        return b"data: " + dump(error) + b"\n\n"

    def error_object(
        self, message: str, type: str, code: str | None = None, **extra: Any
    ) -> dict[str, Any]:
        """A whole error answer's JSON body in this format's shape (the gateway's own
        answers); ``extra`` fields go beside the message."""
        if "://" in message:
            message = mask_text(message)
        return self.error_body(message, type, code, extra)

    def error_body(
        self, message: str, type: str, code: str | None, extra: dict[str, Any]
    ) -> dict[str, Any]:
        """:meth:`error_object`'s shape (``message`` already masked): OpenAI's
        ``{"error": {"message", "type", "code", ...}}``."""
        error: dict[str, Any] = {"message": message, "type": type, "code": code}
        error.update(extra)
        return {"error": error}

    # -- usage ------------------------------------------------------------------------

    def usage(self, obj: dict[str, Any]) -> tuple[int | None, int | None]:
        """The (input, output) tokens one JSON object of this format reports (None where
        it says nothing): OpenAI's ``usage`` (``prompt_tokens``, ``completion_tokens``;
        an embeddings answer's input is all there is)."""
        usage = obj.get("usage")
        if isinstance(usage, dict):
            tokens_in = count(usage.get("prompt_tokens"))
            if "completion_tokens" not in usage and tokens_in is not None:
                return tokens_in, 0
            return tokens_in, count(usage.get("completion_tokens"))
        return None, None

    # -- continuation -----------------------------------------------------------------

    def seam(self, origin: str, sent: bytes, *, ndjson: bool) -> Seam:
        """The seam of an answer whose events ``sent`` (NDJSON lines with ``ndjson``)
        reached the caller from ``origin``; check :attr:`Seam.ok` before continuing it."""
        return refused(origin)

    def check_request(
        self, model: str, prompt: str
    ) -> tuple[bytes, dict[str, Any], dict[str, str]]:
        """The gateway's own smallest streamed request in this format (a one-token
        completion of ``prompt``): its path, its JSON body and the headers it needs
        beyond JSON and ``accept: text/event-stream``. OpenAI chat's."""
        messages = [{"role": "user", "content": prompt}]
        body = {"model": model, "messages": messages, "max_tokens": 1, "stream": True}
        return b"/v1/chat/completions", body, {}


def has_finish_reason(events: bytes) -> bool:
    """True when one of ``events`` carries an OpenAI ``finish_reason`` that is not null."""
    at = events.find(_FINISH_KEY)
    while at >= 0:
        after = at + len(_FINISH_KEY)
        if events[after : after + 8].lstrip(b" \t:")[:1] == b'"':
            return True  # a string value; null (every chunk but the last) is not
        at = events.find(_FINISH_KEY, after)
    return False


def kind_of(name: str | None, data: bytes) -> str | None:
    """An event's type: its ``event`` name, else its data's ``type`` field."""
    if name is not None or not data:
        return name
    try:
        parsed = _json.loads(data)
    except ValueError:
        return None
    kind = parsed.get("type") if isinstance(parsed, dict) else None
    return kind if isinstance(kind, str) else None


def opening_only(opening: frozenset[bytes], events: bytes) -> bool:
    """True when every data event of ``events`` is named, and named in ``opening``."""
    names = event_names(events)
    return bool(names) and len(names) == len(data_values(events)) and set(names) <= opening


def count(value: Any) -> int | None:
    """A token count as a usage block gives it (an int, never negative), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
