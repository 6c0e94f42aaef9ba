"""Anthropic Messages (``anthropic``).

- Recognised by a path ending in ``/messages``.
- Opening events, not progress: ``message_start``, ``ping`` and
  ``content_block_start`` before the first text; after it, a lone ``ping``.
- Complete at ``event: message_stop`` (``ping`` events after it do not count);
  ``data: [DONE]`` is not Anthropic's.
- An error after the response began: ``event: error`` with
  ``{"type":"error","error":{"type":...,"message":...}}`` in Anthropic's error types
  (docs.anthropic.com/en/api/errors); the ``anthropic`` SDK raises on an ``error``
  event and skips any event without an ``event:`` line (anthropic/_streaming.py). A
  whole error answer has the same body.
- Usage: the body's ``usage`` (``input_tokens``, ``output_tokens``); in a stream,
  ``message_start``'s ``message.usage.input_tokens`` and ``message_delta``'s
  ``usage.output_tokens`` (cumulative: the last one counts).
- Heartbeat lines (SSE comments) may go in (the SDK skips comment lines).
- Continuation (:class:`MessagesSeam`): ``message_start`` is not repeated; the first
  text block continues the open one (its ``content_block_start`` is dropped) or, if it
  was closed, becomes the next index; every later block's index follows on;
  ``message_delta`` says who wrote the answer. At the caller's token limit: the open
  block stopped, a ``message_delta`` with ``"stop_reason": "max_tokens"``, then
  ``message_stop``. A prefill is the format's own rule (a trailing assistant message
  is continued), but may not end in whitespace (a 400): the seam cuts what the next
  tier writes again.

The shapes are Anthropic's streaming reference (docs.anthropic.com/en/api/messages-streaming).
"""

from __future__ import annotations

from typing import Any

from ..sse import events as sse_events
from ..sse import last_event
from .base import WireFormat, count, kind_of, opening_only, refused
from .seam import Seam, dump, load, tokens

__all__ = ["Messages", "MessagesSeam"]

# Anthropic's error types (docs.anthropic.com/en/api/errors) for tierchain's error types.
_TYPES = {
    "backend_saturated": "overloaded_error",
    "budget_exhausted": "timeout_error",
    "request_timeout": "timeout_error",
}
_OWN = frozenset(
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
_PINGS = frozenset({"ping"})


class Messages(WireFormat):
    """Anthropic Messages: see the module docstring."""

    name = "anthropic"
    paths = (b"/messages",)
    opening = frozenset({b"message_start", b"ping", b"content_block_start"})
    error_passes = False
    prefill = "native"

    def no_progress(self, events: bytes, started: bool) -> bool:
        if started:  # after the first text, only a lone ping
            return events.startswith(b"event: ping") and (
                events.count(b"\n\n") + events.count(b"\r\n\r\n") == 1
            )
        return opening_only(self.opening, events)

    def judge(self, previous: bytes, last: bytes, end: bytes | None) -> tuple[bool, bool]:
        # A ping alone is never kept as the last event; one released with others is
        # passed over here, wherever the bytes were split.
        name, data = last_event(previous + last, ignore=_PINGS)
        return kind_of(name, data) == "message_stop", False

    def whole(self, terminated: bool, finish_seen: bool, end: bytes | None) -> bool:
        return terminated

    def error_event(self, message: str, type: str, code: str | None) -> bytes:
        kind = _TYPES.get(type, "api_error")
        payload = {"type": "error", "error": {"type": kind, "message": message}}
        return b"event: error\ndata: " + dump(payload) + b"\n\n"

    def error_body(
        self, message: str, type: str, code: str | None, extra: dict[str, Any]
    ) -> dict[str, Any]:
        kind = type if type in _OWN else _TYPES.get(type, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message, **extra}}

    def usage(self, obj: dict[str, Any]) -> tuple[int | None, int | None]:
        kind = obj.get("type")
        if kind == "message_start":
            message = obj.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
            if isinstance(usage, dict):
                return count(usage.get("input_tokens")), None
            return None, None
        usage = obj.get("usage")
        if not isinstance(usage, dict):
            return None, None
        if kind == "message_delta":
            return None, count(usage.get("output_tokens"))
        return count(usage.get("input_tokens")), count(usage.get("output_tokens"))

    def seam(self, origin: str, sent: bytes, *, ndjson: bool) -> Seam:
        return refused(origin) if ndjson else MessagesSeam(origin, sent)

    def check_request(
        self, model: str, prompt: str
    ) -> tuple[bytes, dict[str, Any], dict[str, str]]:
        messages = [{"role": "user", "content": prompt}]
        body = {"model": model, "max_tokens": 1, "messages": messages, "stream": True}
        return b"/v1/messages", body, {"anthropic-version": "2023-06-01"}


class MessagesSeam(Seam):
    """The seam of an Anthropic Messages stream (see the module docstring)."""

    wire = "anthropic"

    def __init__(self, origin: str, events: bytes) -> None:
        super().__init__(origin)
        self.last_index = -1
        self.open = False  # the last block is still open (no content_block_stop)
        text: list[str] = []
        for name, data in sse_events(events):
            obj = load(data)
            if not isinstance(obj, dict):
                continue
            kind = obj.get("type", name)
            if kind == "content_block_start":
                block = obj.get("content_block") or {}
                if block.get("type") != "text":
                    self._refuse(str(block.get("type")))  # tool_use, thinking: not text
                self.last_index = int(obj.get("index", self.last_index + 1))
                self.open = True
                if isinstance(block.get("text"), str):
                    text.append(block["text"])
            elif kind == "content_block_delta":
                delta = obj.get("delta") or {}
                if delta.get("type") != "text_delta":
                    self._refuse(str(delta.get("type")))
                elif isinstance(delta.get("text"), str):
                    text.append(delta["text"])
            elif kind == "content_block_stop":
                self.open = False
        self.text = "".join(text)
        self.units = tokens(text)
        self._offset = 0
        self._first_block = True

    def _ending(self) -> list[tuple[str | None, Any]]:
        events: list[tuple[str | None, Any]] = []
        if self.open:
            stop = {"type": "content_block_stop", "index": self.last_index}
            events.append(("content_block_stop", stop))
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
            "usage": {"output_tokens": self.used},
            "tierchain": self._mark(),
        }
        events.append(("message_delta", delta))
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    def _map(self, name: str | None, obj: Any) -> list[tuple[str | None, Any]]:
        if not isinstance(obj, dict):
            return [(name, obj)]
        kind = obj.get("type", name)
        if kind == "message_start":
            return []
        if kind == "content_block_start":
            index = int(obj.get("index", 0))
            block = obj.get("content_block") or {}
            if self._first_block:
                self._first_block = False
                if self.open and block.get("type") == "text":
                    self._offset = self.last_index - index  # into the open block
                    if block.get("text"):
                        delta = {"type": "text_delta", "text": block["text"]}
                        return [
                            (
                                "content_block_delta",
                                {"type": "content_block_delta", "index": index, "delta": delta},
                            )
                        ]
                    return []
                if self.open:
                    # Not text: the open block ends first.
                    stop = {"type": "content_block_stop", "index": self.last_index}
                    self.open = False
                    self._offset = self.last_index + 1 - index
                    return [
                        ("content_block_stop", stop),
                        (name, {**obj, "index": index + self._offset}),
                    ]
                self._offset = self.last_index + 1 - index
            return [(name, {**obj, "index": index + self._offset})]
        if kind in ("content_block_delta", "content_block_stop") and "index" in obj:
            return [(name, {**obj, "index": int(obj["index"]) + self._offset})]
        if kind == "message_delta":
            return [(name, {**obj, "tierchain": self._mark()})]
        return [(name, obj)]

    def _delta(self, name: str | None, obj: Any) -> str | None:
        if not isinstance(obj, dict) or obj.get("type") != "content_block_delta":
            return None
        delta = obj.get("delta") or {}
        text = delta.get("text")
        return text if delta.get("type") == "text_delta" and isinstance(text, str) else None

    def _with_delta(self, name: str | None, obj: Any, text: str) -> Any:
        return {**obj, "delta": {**obj["delta"], "text": text}}
