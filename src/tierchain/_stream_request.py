"""Does a request want an event stream? Heartbeats asks before it commits one.

Yes when it accepts ``text/event-stream``; otherwise its JSON body says so with
``"stream": true``. The body is only watched as the inner app reads it (never
read on the app's behalf), up to ``SNIFF_LIMIT`` bytes, and parsed once, when it
is complete.
"""

from __future__ import annotations

from typing import Any

from . import _json
from ._types import Message

__all__ = ["SNIFF_LIMIT", "StreamRequest", "accepts_event_stream"]

SNIFF_LIMIT = 32 * 2**20  # request bytes kept to read "stream" when nothing inside did


def accepts_event_stream(headers: Any) -> bool:
    """Does an ``Accept`` header list ``text/event-stream``?"""
    for key, value in headers:
        if key.lower() == b"accept":
            for item in value.split(b","):
                if item.split(b";", 1)[0].strip().lower() == b"text/event-stream":
                    return True
    return False


class StreamRequest:
    """What one request says of streaming. ``accept``: its Accept header asked for an
    event stream; ``done``: its body is in; ``awaiting``: a commit waits for the body
    to say (set and cleared by Heartbeats)."""

    __slots__ = ("accept", "awaiting", "done", "parts", "size", "sniffed")

    def __init__(self, accept: bool) -> None:
        self.accept = accept
        self.done = False
        self.awaiting = False
        self.parts: list[bytes] | None = None if accept else []  # None: not kept
        self.size = 0
        self.sniffed: bool | None = None

    def add(self, message: Message) -> bool:
        """Watch one ``http.request`` message; True when it completed the body."""
        if self.done:
            return False
        chunk = message.get("body", b"")
        if chunk and self.parts is not None:
            self.size += len(chunk)
            if self.size > SNIFF_LIMIT:
                self.parts = None
            else:
                self.parts.append(chunk)
        if message.get("more_body", False):
            return False
        self.done = True
        return True

    def says_stream(self) -> bool | None:
        """The body's ``"stream": true``, once it is complete (None until then)."""
        if self.sniffed is None and self.done:
            parts, self.parts = self.parts, None
            self.sniffed = parts is not None and _says_stream(parts)
        return self.sniffed


def _says_stream(parts: list[bytes]) -> bool:
    try:
        data = _json.loads(b"".join(parts))
    except (UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and data.get("stream") is True
