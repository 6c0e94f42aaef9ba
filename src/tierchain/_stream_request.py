"""Does a request want an event stream? Heartbeats asks before it commits one.

Yes when it accepts ``text/event-stream``; otherwise its JSON body says so with
``"stream": true``. The body is only watched as the inner app reads it (never
read on the app's behalf), up to ``SNIFF_LIMIT`` bytes, and parsed once, when it
is complete (Heartbeats' ``_Stream`` keeps what it saw: an object less a request).
A body longer than ``SNIFF_PARSE`` is not parsed for it: the layer inside that reads
it anyway (Failover) says, once it has bounded the body's shape.
"""

from __future__ import annotations

from typing import Any

from . import _json

__all__ = ["SNIFF_LIMIT", "SNIFF_PARSE", "accepts_event_stream", "says_stream"]

SNIFF_LIMIT = 32 * 2**20  # request bytes kept to read "stream" when nothing inside did
SNIFF_PARSE = 2**20  # longer, the body is not parsed here (on the event loop) to find out


def accepts_event_stream(headers: Any) -> bool:
    """Does an ``Accept`` header list ``text/event-stream``?"""
    for key, value in headers:
        if len(key) == 6 and key.lower() == b"accept":  # (a lower() only for a likely one)
            for item in value.split(b","):
                if item.split(b";", 1)[0].strip().lower() == b"text/event-stream":
                    return True
    return False


def says_stream(parts: list[bytes]) -> bool:
    """Does a complete JSON body (its ``parts``) say ``"stream": true``?"""
    try:
        data = _json.loads(b"".join(parts))
    except (UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and data.get("stream") is True
