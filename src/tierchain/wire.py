"""A request's wire format, by name: what the layers keep on the request, and the rules
that are no one format's.

The formats themselves are :mod:`tierchain.formats`, one module each (what counts as
progress, a complete stream, an error after the response began, usage, heartbeat
lines, continuation); a layer asks ``formats.of(req.wire)``. Here are the names
(``openai``, ``responses``, ``anthropic``, ``ollama``, ``plain``: :data:`FORMATS`, as
``wire_format=`` takes them, checked by :func:`check_format`), a request path's
format by name (:func:`recognise`, kept for the few paths a gateway sees again and
again; :func:`error_format` for the gateway's own errors), a whole answer that came
after an event stream began (:func:`answer_event`) and a context-window refusal in
any server's wording (:func:`context_exceeded`).

``Backend(wire_format=...)`` and ``Routes(..., wire_formats={route: format})``
override what the path says. A backend's ``stream_end`` applies to the ``openai``
and ``plain`` formats.
"""

from __future__ import annotations

import json
import re
from typing import Any

from . import _json, formats
from .formats import NDJSON, SSE

__all__ = [
    "ANTHROPIC",
    "FORMATS",
    "NDJSON",
    "OLLAMA",
    "OPENAI",
    "PLAIN",
    "RESPONSES",
    "SSE",
    "LateAnswer",
    "answer_event",
    "check_format",
    "context_exceeded",
    "error_format",
    "recognise",
]

OPENAI = "openai"
RESPONSES = "responses"
ANTHROPIC = "anthropic"
OLLAMA = "ollama"
PLAIN = "plain"
FORMATS = tuple(formats.TABLE)
"""Every wire format name, as ``wire_format=`` takes it (:data:`tierchain.formats.TABLE`)."""


_SEEN: dict[bytes | str, str] = {}  # the few paths a gateway sees again and again
_SEEN_MAX = 256


def recognise(path: bytes | str) -> str:
    """The wire format a request path speaks (``openai`` when no other claims it)."""
    wire = _SEEN.get(path)
    if wire is None:
        if len(path) > _SEEN_MAX:
            return _recognise(path)  # a long path is not kept (a caller chooses it)
        if len(_SEEN) >= _SEEN_MAX:
            _SEEN.clear()  # many distinct paths: start again, never grow
        wire = _SEEN[path] = _recognise(path)
    return wire


def _recognise(path: bytes | str) -> str:
    if isinstance(path, str):
        path = path.encode("utf-8", "surrogateescape")
    return formats.recognise(path).name


def error_format(path: bytes | str) -> str:
    """The format of an error the gateway answers itself on ``path`` (Ollama's on any
    ``/api/`` path: :func:`tierchain.formats.error_owner`)."""
    raw = path.encode("utf-8", "surrogateescape") if isinstance(path, str) else path
    owner = formats.error_owner(raw)
    return owner.name if owner is not None else recognise(path)


def check_format(what: str, value: Any) -> str | None:
    """``value`` when it is a known format name (or None); else a ValueError naming ``what``."""
    if value is None or (isinstance(value, str) and value in FORMATS):
        return value
    raise ValueError(f"{what} must be one of {', '.join(FORMATS)} (or unset), got {value!r}")


class LateAnswer:
    """A non-stream answer that arrives after the response began as an event stream:
    its status and (up to ``LIMIT`` bytes) its body, which become one event
    (:func:`answer_event`)."""

    LIMIT = 2**20

    __slots__ = ("parts", "size", "status")

    def __init__(self, status: int) -> None:
        self.status = status
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, chunk: bytes) -> None:
        if chunk and self.size < self.LIMIT:
            self.parts.append(chunk)
            self.size += len(chunk)

    def event(self, wire: str) -> bytes:
        return answer_event(self.status, b"".join(self.parts), wire)


def answer_event(status: int, body: bytes, wire: str) -> bytes:
    """One SSE event standing for a whole non-stream answer (``status``, ``body``) that
    arrived after the response began as an event stream: a 2xx answer as one ``data:``
    event, any other as an error in ``wire``'s own shape (``WireFormat.error_bytes``)."""
    try:
        data: Any = _json.loads(body) if body else None
    except (UnicodeDecodeError, ValueError):
        data = None
    if 200 <= status < 300 and isinstance(data, dict) and "error" not in data:
        # A whole non-stream answer: one data event.
        text = json.dumps(data, separators=(",", ":"), ensure_ascii=False, default=str)
        return b"data: " + text.encode() + b"\n\n"
    message = f"the gateway answered {status}"
    kind, code = "upstream_error", f"http_{status}"
    error = data.get("error") if isinstance(data, dict) else None
    fmt = formats.of(wire)
    if isinstance(error, dict) and fmt.error_passes:
        # OpenAI's own shape: the error object as it came, every field kept.
        text = json.dumps({"error": error}, separators=(",", ":"), ensure_ascii=False, default=str)
        return b"data: " + text.encode() + b"\n\n"
    if isinstance(error, dict):
        message = str(error.get("message") or message)
        kind = str(error.get("type") or kind)
        code = str(error.get("code") or code)
    elif isinstance(error, str):
        message = error
    elif data is None and body:
        message += ": " + body[:500].decode("utf-8", "replace")
    return fmt.error_bytes(SSE, message, kind, code)


# A context-window refusal, as each server words it in its 400 answer:
# - OpenAI: {"error": {..., "code": "context_length_exceeded"}} and "This model's
#   maximum context length is N tokens" (also vLLM's wording);
# - Anthropic: {"type":"error","error":{"type":"invalid_request_error",
#   "message":"prompt is too long: N tokens > M maximum"}};
# - llama.cpp's server: {"error":{"code":400,"type":"exceed_context_size_error",
#   "message":"request (N tokens) exceeds the available context size (M tokens), try
#   increasing it", ...}} (tools/server/server-common.cpp, format_error_response;
#   tools/server/server-context.cpp);
# - Ollama: {"error":"the input length exceeds the context length"} and "input length
#   exceeds maximum context length" (with truncate: false).
_CONTEXT = re.compile(
    rb"context_length_exceeded|exceed_context_size_error|exceeds the available context size"
    rb"|prompt is too long|maximum context length|exceeds the context length",
    re.IGNORECASE,
)


def context_exceeded(body: bytes) -> bool:
    """True when a 400 answer's body says the request does not fit the model's context."""
    return _CONTEXT.search(body[:65536]) is not None
