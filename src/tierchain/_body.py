"""Buffering the request body once so every attempt can replay it whole."""

from __future__ import annotations

from ._types import Message, Receive, Scope
from .errors import BodyTooLarge


class CallerGone(Exception):
    """The caller disconnected before the request body was complete."""


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """Read the whole request body, refusing more than ``limit`` bytes.

    A declared ``content-length`` over the limit is refused before reading.
    """
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                declared = -1
            if declared > limit:
                raise BodyTooLarge(limit)
            break
    parts: list[bytes] = []
    size = 0
    while True:
        message: Message = await receive()
        kind = message["type"]
        if kind == "http.disconnect":
            raise CallerGone
        if kind != "http.request":
            continue
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)
