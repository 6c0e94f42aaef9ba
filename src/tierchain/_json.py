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

A caller's body is also bounded by its shape before anything parses it (:func:`check_shape`):
the parser's cost grows with the values it builds (an empty array costs about a microsecond,
so 30 MB of ``[[],[],...]`` held the event loop for seconds), so a body with more than
:data:`MAX_CONTAINERS` arrays and objects or :data:`MAX_VALUES` values is refused as
:class:`TooComplex`, a ``ValueError``, counted outside its strings a slice at a time with the
event loop free between slices.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

__all__ = [
    "MAX_CONTAINERS",
    "MAX_DEPTH",
    "MAX_VALUES",
    "TooComplex",
    "TooDeep",
    "check_shape",
    "depth_ok",
    "loads",
    "members",
]

MAX_DEPTH = 128
"""The deepest nesting of arrays and objects accepted (serde_json's default limit too)."""


class TooDeep(ValueError):
    """A JSON text nested deeper than :data:`MAX_DEPTH`."""

    def __init__(self) -> None:
        super().__init__(f"JSON nested deeper than {MAX_DEPTH} levels")


MAX_CONTAINERS = 50_000
"""The most arrays and objects a caller's body may hold (:func:`check_shape`)."""

MAX_VALUES = 200_000
"""The most values (arrays, objects, strings, numbers...) a caller's body may hold."""

_SLICE = 256 * 1024  # bytes looked at between two turns of the event loop
_STEPS = 1_000  # strings passed between two turns of the event loop, at most
# The rest of a JSON string from inside it: up to its closing quote (not consumed), escapes
# passed whole (the unrolled form: a C loop per run of plain bytes, never per byte).
_IN_STRING = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)


class TooComplex(ValueError):
    """A JSON text with more arrays and objects, or values, than a caller's body may hold."""

    def __init__(self, what: str, limit: int) -> None:
        super().__init__(f"the JSON text holds more than {limit:,} {what}")


async def check_shape(text: bytes) -> int | None:
    """Refuse ``text`` as :class:`TooComplex` when it holds more than
    :data:`MAX_CONTAINERS` arrays and objects or :data:`MAX_VALUES` values, counted
    outside its strings, before anything parses it; else the number of arrays and
    objects it holds (None for a text too short to hold too many: not counted).

    The count runs a slice of ``text`` at a time (C searches within each), and lets
    the event loop run between slices: a 30 MB body costs the loop a few milliseconds
    at a time, never the whole count at once. A text that is not JSON is left to the
    parser to refuse.
    """
    end = len(text)
    if end <= 2 * MAX_CONTAINERS:  # (each array or object takes two bytes at least)
        return None
    containers = values = 0
    pos = 0
    inside = False  # within a string
    while pos < end:
        stop = min(pos + _SLICE, end)
        steps = 0
        while pos < stop and steps < _STEPS:
            steps += 1
            if inside:
                matched = _IN_STRING.match(text, pos, stop)
                pos = matched.end() if matched is not None else pos
                if pos < stop and text[pos] == 0x22:  # the closing quote
                    inside = False
                    pos += 1
                    values += 1
                elif pos < stop:  # an escape cut by the slice's end: from it, next turn
                    if stop == end:
                        return containers  # a string that never ends: not JSON
                    break
            else:
                quote = text.find(b'"', pos, stop)
                upto = stop if quote < 0 else quote
                containers += text.count(b"[", pos, upto) + text.count(b"{", pos, upto)
                values += text.count(b",", pos, upto)
                if quote < 0:
                    pos = stop
                else:
                    inside = True
                    pos = quote + 1
            if containers > MAX_CONTAINERS:
                raise TooComplex("arrays and objects", MAX_CONTAINERS)
            if containers + values > MAX_VALUES:
                raise TooComplex("values", MAX_VALUES)
        await asyncio.sleep(0)
    return containers


_TOKEN = re.compile(rb'["\[\]{}]')  # what changes a walk's place: a string, a bracket
_BLANK = b" \t\r\n"
_WINDOW = 64 * 1024  # the most bytes of a member's value decoded to read it
_SCAN: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


async def members(text: bytes, names: frozenset[str]) -> dict[str, Any] | None:
    """The values of the top-level members ``names`` of the JSON object ``text``, found
    without parsing the rest (the event loop free between slices, as :func:`check_shape`);
    None when ``text`` is not an object this walk can read (the caller parses it whole,
    and the parser says what is wrong).

    For a long body whose route is all that is wanted now (its ``model`` and ``stream``):
    the messages' megabytes are passed over, never built into objects. A member named
    twice counts as the parser would count it: the last. ``text`` is not otherwise checked
    to be JSON; call :func:`check_shape` first.
    """
    end = len(text)
    pos = 0
    while pos < end and text[pos] in _BLANK:
        pos += 1
    if pos >= end or text[pos] != 0x7B:  # "{"
        return None
    pos += 1
    depth = 1
    found: dict[str, Any] = {}
    wanted = {name.encode(): name for name in names}
    turn = pos + _SLICE
    steps = 0
    while True:
        steps += 1
        if pos >= turn or steps >= _STEPS:
            await asyncio.sleep(0)
            turn = pos + _SLICE
            steps = 0
        hit = _TOKEN.search(text, pos, min(pos + _SLICE, end))
        if hit is None:
            if pos + _SLICE >= end:
                return None  # the object never closes
            pos += _SLICE
            continue
        at = hit.start()
        mark = text[at]
        if mark == 0x22:  # a string: to its closing quote, a slice at a time
            closed = await _string_end(text, at + 1)
            if closed is None:
                return None
            pos = closed + 1
            if depth == 1:
                after = pos
                while after < end and text[after] in _BLANK:
                    after += 1
                if after < end and text[after] == 0x3A:  # ":": it was a member's name
                    name = wanted.get(text[at + 1 : closed])
                    if name is not None:
                        value = _value_at(text, after + 1)
                        if value is _UNREAD:
                            return None
                        found[name] = value
        elif mark in (0x5B, 0x7B):  # "[" "{"
            depth += 1
            pos = at + 1
        else:  # "]" "}"
            depth -= 1
            pos = at + 1
            if depth == 0:
                return found


_UNREAD = object()


def _value_at(text: bytes, pos: int) -> Any:
    """The JSON value that starts at ``pos`` (blanks first), read from a window of at most
    ``_WINDOW`` bytes; ``_UNREAD`` when it is not whole there."""
    window = text[pos : pos + _WINDOW].decode("utf-8", "ignore")
    start = len(window) - len(window.lstrip(" \t\r\n"))
    try:
        value, _ = _SCAN(window, start)
    except (StopIteration, ValueError):
        return _UNREAD
    return value


async def _string_end(text: bytes, pos: int) -> int | None:
    """Where the string whose content starts at ``pos`` has its closing quote (None: none)."""
    end = len(text)
    while pos < end:
        stop = min(pos + _SLICE, end)
        matched = _IN_STRING.match(text, pos, stop)
        pos = matched.end() if matched is not None else pos
        if pos < stop and text[pos] == 0x22:
            return pos
        if stop == end:
            return None  # never closed (or an escape cut by the text's end)
        await asyncio.sleep(0)
    return None


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


def loads(text: bytes | bytearray | str, *, containers: int | None = None) -> Any:
    """``json.loads(text)``, raising :class:`TooDeep` (a ``ValueError``) past the depth limit.

    Raises ``ValueError`` (``UnicodeDecodeError`` is one) for anything ``json.loads`` refuses.
    ``containers``: the text's arrays and objects as :func:`check_shape` counted them, so
    that they are not counted again.
    """
    if isinstance(text, bytearray):
        text = bytes(text)
    if depth_ok(text) if containers is None else containers <= MAX_DEPTH:
        return json.loads(text)
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep() from None
    if isinstance(value, dict | list) and not _depth_within(value):
        raise TooDeep()
    return value
