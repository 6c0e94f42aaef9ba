"""Wire formats: what each protocol a request speaks counts as whole, and how it fails.

A request speaks one wire format, and that format decides three things the
layers need: what a complete stream is, what counts as progress, and how an
error is written once the response has started, so that the format's own SDK
raises it. This module is the one place that knows them:

- ``openai`` (OpenAI chat, completions, embeddings; a path ending in
  ``/chat/completions``, ``/completions`` or ``/embeddings``, and any path no
  other format claims): complete at ``data: [DONE]``, or a ``finish_reason`` in
  one of the last two data events; an error is ``data: {"error": {...}}``.
- ``responses`` (OpenAI Responses, ``/responses``): complete at ``event:
  response.completed``; ``response.failed`` and ``response.incomplete`` are the
  upstream's own whole answers, not truncations; an error is ``event: error``
  carrying an ``error`` object.
- ``anthropic`` (Anthropic Messages, ``/messages``): complete at ``event:
  message_stop``; an error is ``event: error`` with
  ``{"type":"error","error":{"type":...,"message":...}}``.
- ``ollama`` (Ollama's native API, ``/api/chat``, ``/api/generate``,
  ``/api/embed``): NDJSON, complete at a line with ``"done": true``; an error
  is an ``{"error": "..."}`` line.
- ``plain`` (only when asked for): complete at any clean end after data (or at
  the backend's ``stream_end`` string); errors as ``openai``.

Progress is the first complete data event of an event stream, the first
complete line of an NDJSON stream, and, for any other body, the whole body.
The format is recognised once per request from its path (:func:`recognise`:
a few ``endswith`` checks); ``Backend(wire_format=...)`` and
``Routes(..., wire_formats={route: format})`` override it. A backend's
``stream_end`` still applies to the ``openai`` and ``plain`` formats.

Heartbeat lines are SSE comments, so they only ever go into an event stream
(:func:`allows_comments`): an Ollama request gets none, and is never
committed as ``text/event-stream`` on the gateway's own account.
"""

from __future__ import annotations

import json
import re
from typing import Any

from . import _json
from .masking import mask_text

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
    "allows_comments",
    "answer_event",
    "check_format",
    "context_exceeded",
    "error_bytes",
    "error_format",
    "error_object",
    "recognise",
]

OPENAI = "openai"
RESPONSES = "responses"
ANTHROPIC = "anthropic"
OLLAMA = "ollama"
PLAIN = "plain"
FORMATS = (OPENAI, RESPONSES, ANTHROPIC, OLLAMA, PLAIN)
"""Every wire format name, as ``wire_format=`` takes it."""

SSE = 1
"""Framing: ``text/event-stream`` (events end with a blank line)."""
NDJSON = 2
"""Framing: ``application/x-ndjson`` (one JSON object per line)."""

_OPENAI_PATHS = (b"/chat/completions", b"/completions", b"/embeddings")
_OLLAMA_PATHS = (b"/api/chat", b"/api/generate", b"/api/embed", b"/api/embeddings")


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
    path = path.rstrip(b"/")
    if path.endswith(_OPENAI_PATHS):
        return OPENAI  # the usual case, first
    if path.endswith(b"/responses"):
        return RESPONSES
    if path.endswith(b"/messages"):
        return ANTHROPIC
    if path.endswith(_OLLAMA_PATHS):
        return OLLAMA
    return OPENAI


def error_format(path: bytes | str) -> str:
    """The shape of an error the gateway answers itself on ``path``: Ollama's on any
    ``/api/`` path (Ollama's own apps read ``{"error": "..."}`` there), else as
    :func:`recognise` says."""
    if isinstance(path, str):
        path = path.encode("utf-8", "surrogateescape")
    if path.startswith(b"/api/"):
        return OLLAMA
    return recognise(path)


def check_format(what: str, value: Any) -> str | None:
    """``value`` when it is a known format name (or None); else a ValueError naming ``what``."""
    if value is None or (isinstance(value, str) and value in FORMATS):
        return value
    raise ValueError(f"{what} must be one of {', '.join(FORMATS)} (or unset), got {value!r}")


def allows_comments(wire: str | None) -> bool:
    """True when heartbeat lines (SSE comments) may go into this format's streams."""
    return wire != OLLAMA


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)

# Anthropic's error types (docs.anthropic.com/en/api/errors) for tierchain's error types.
_ANTHROPIC_TYPES = {
    "backend_saturated": "overloaded_error",
    "budget_exhausted": "timeout_error",
    "request_timeout": "timeout_error",
}


def error_bytes(
    wire: str | None, framing: int, message: str, type: str, code: str | None = None
) -> bytes:
    """An error written after the response began, so that ``wire``'s own SDK raises it.

    ``framing`` is :data:`SSE` or :data:`NDJSON` (the response's own framing).

    - NDJSON (Ollama): ``{"error": "..."}`` and a newline: the ``ollama`` client
      raises ``ResponseError`` for a line with an ``error`` (ollama/_client.py).
    - Anthropic: ``event: error`` with ``{"type":"error","error":{"type","message"}}``:
      the ``anthropic`` SDK raises on an ``error`` event and skips any event
      without an ``event:`` line (anthropic/_streaming.py).
    - Responses: ``event: error`` carrying the Responses error event's fields
      (``type``, ``code``, ``message``, ``param``) and an ``error`` object: the
      ``openai`` SDK raises ``APIError`` for a data object with ``error``
      (openai/_streaming.py), and the Agents SDK for an ``error`` event.
    - OpenAI chat and plain: ``data: {"error": {"message","type","code"}}``.
    """
    if "://" in message:
        message = mask_text(message)
    if framing == NDJSON:
        return _ENCODER.encode({"error": message}).encode() + b"\n"
    if wire == ANTHROPIC:
        kind = _ANTHROPIC_TYPES.get(type, "api_error")
        payload = {"type": "error", "error": {"type": kind, "message": message}}
        return b"event: error\ndata: " + _ENCODER.encode(payload).encode() + b"\n\n"
    if wire == RESPONSES:
        fields: dict[str, Any] = {
            "type": "error",
            "code": code,
            "message": message,
            "param": None,
            "error": {"type": type, "code": code, "message": message},
        }
        return b"event: error\ndata: " + _ENCODER.encode(fields).encode() + b"\n\n"
    error = {"error": {"message": message, "type": type, "code": code}}
    return b"data: " + _ENCODER.encode(error).encode() + b"\n\n"


_ANTHROPIC_OWN = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "request_too_large",
        "rate_limit_error",
        "api_error",
        "overloaded_error",
        "timeout_error",
    }
)


def error_object(
    wire: str | None, message: str, type: str, code: str | None = None, **extra: Any
) -> dict[str, Any]:
    """A whole error answer's JSON body, in ``wire``'s own shape (the gateway's own answers).

    - Ollama: ``{"error": "..."}``, what Ollama itself answers and its clients read
      (``extra`` fields beside it).
    - Anthropic: ``{"type": "error", "error": {"type", "message", ...}}`` (its error
      types; ``extra`` fields in the error object).
    - OpenAI, Responses and plain: ``{"error": {"message", "type", "code", ...}}``.
    """
    if "://" in message:
        message = mask_text(message)
    if wire == OLLAMA:
        return {"error": message, **extra}
    if wire == ANTHROPIC:
        kind = type if type in _ANTHROPIC_OWN else _ANTHROPIC_TYPES.get(type, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message, **extra}}
    error: dict[str, Any] = {"message": message, "type": type, "code": code}
    error.update(extra)
    return {"error": error}


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
    event, any other as an error in ``wire``'s own shape (see :func:`error_bytes`)."""
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
    if isinstance(error, dict) and wire not in (ANTHROPIC, RESPONSES):
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
    return error_bytes(wire, SSE, message, kind, code)


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
