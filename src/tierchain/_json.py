"""The one JSON loader: ``json.loads`` with its nesting depth bounded.

Every JSON text the package parses (a caller's body, an upstream's answer or error body, a
status page, an Admin request) goes through :func:`loads`. Python's parser recurses once per
nested array or object, so a few kilobytes of ``[[[[...`` reach the interpreter's recursion
limit and raise :class:`RecursionError`, which is not a :class:`ValueError`: a caller's body
became a 500 with a traceback, an upstream's error body a 500 that never failed over. Here a
text nested deeper than :data:`MAX_DEPTH` is refused as :class:`TooDeep`, a ``ValueError``,
so every caller of the loader treats it as the invalid JSON it already handles.

The depth is checked without recursion and, for the usual text, without a walk: a text with
no more than ``MAX_DEPTH`` opening brackets cannot nest deeper, and is parsed as it is. Only a
text with more is walked once after parsing (an explicit stack, never the Python stack).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_DEPTH", "TooDeep", "depth_ok", "loads"]

MAX_DEPTH = 128
"""The deepest nesting of arrays and objects accepted (serde_json's default limit too)."""


class TooDeep(ValueError):
    """A JSON text nested deeper than :data:`MAX_DEPTH`."""

    def __init__(self) -> None:
        super().__init__(f"JSON nested deeper than {MAX_DEPTH} levels")


def depth_ok(text: bytes | str) -> bool:
    """True when ``text`` cannot nest deeper than :data:`MAX_DEPTH` (a count, no parse)."""
    if isinstance(text, str):
        return text.count("[") + text.count("{") <= MAX_DEPTH
    return text.count(b"[") + text.count(b"{") <= MAX_DEPTH


def _depth_within(value: Any) -> bool:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, dict | list):
                if depth >= MAX_DEPTH:
                    return False
                stack.append((child, depth + 1))
    return True


def loads(text: bytes | bytearray | str) -> Any:
    """``json.loads(text)``, raising :class:`TooDeep` (a ``ValueError``) past the depth limit.

    Raises ``ValueError`` (``UnicodeDecodeError`` is one) for anything ``json.loads`` refuses.
    """
    if isinstance(text, bytearray):
        text = bytes(text)
    if depth_ok(text):
        return json.loads(text)
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep() from None
    if isinstance(value, dict | list) and not _depth_within(value):
        raise TooDeep()
    return value
