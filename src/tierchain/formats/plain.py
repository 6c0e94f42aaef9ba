"""Plain (``plain``, only when asked for with ``wire_format="plain"``): an event stream
with no terminator of its own.

- Never recognised from a path: a backend or route names it.
- Complete at any clean end after data, or at the backend's ``stream_end`` string when
  one is named.
- Errors, usage and heartbeat lines as OpenAI chat's (:mod:`.openai_chat`).
- No continuation: the gateway cannot tell what of its events is answer text.
"""

from __future__ import annotations

from .base import WireFormat

__all__ = ["Plain"]


class Plain(WireFormat):
    """Any event stream: complete at a clean end unless a terminator was named."""

    name = "plain"

    def stream_end(self, configured: str | None) -> bytes | None:
        if configured == "openai":
            return None  # the default: any clean end, unless a terminator was named
        return super().stream_end(configured)
