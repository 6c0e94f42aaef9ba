"""The one check for a duration or a count a user passes, and the one grammar for a duration
written as text.

Every duration a public class or function takes goes through :func:`duration`: a number of
seconds (``int`` or ``float``) or a :class:`datetime.timedelta`; ``bool``, NaN, infinity and
negative values are refused, each with the same sentence (``slow_after must be a finite
number of seconds > 0 (or a timedelta), got nan``). Every whole-number option (a limit, a
threshold, a size in bytes) goes through :func:`count`. Both run when an object is built,
never per request.

Text durations (``TIERCHAIN_*`` variables, routes-file strings, the Admin's pin ttl) are read
by :func:`parse_duration` alone: plain seconds (``30``, ``2.5``) or a number with one of the
units ``ms``, ``s``, ``m``, ``h``, ``d`` (``250ms``, ``2.5s``, ``1m``, ``4h``, ``2d``).
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Literal, overload

__all__ = ["HEADER_NAME", "TEXT_DURATION", "count", "duration", "parse_duration", "text_seconds"]

TEXT_DURATION = "seconds such as 30, 2.5, 500ms, 15m or 2h"
"""How the text grammar of :func:`parse_duration` is described to a user."""

_TEXT = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ms|s|m|h|d)?\s*", re.IGNORECASE)
_UNITS = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds from ``text``: ``30``, ``2.5``, ``250ms``, ``2.5s``, ``1m``, ``4h``, ``2d``.

    Surrounding spaces are ignored and the unit's case does not matter. ``ValueError`` for
    anything else: a sign, an exponent, an unknown unit. The value is never negative and
    never NaN; digits too many to be a float give infinity, so the caller's range check
    (which decides what it accepts) refuses them with its own words.
    """
    match = _TEXT.fullmatch(text)
    if match is None:
        raise ValueError(f"not a duration such as 30, 2.5, 500ms, 15m or 2h: {text[:40]!r}")
    return float(match[1]) * _UNITS[(match[2] or "").lower()]


def text_seconds(text: str, *, zero_ok: bool = True) -> float:
    """Seconds from ``text`` (:func:`parse_duration`), finite, and above zero unless
    ``zero_ok``: a bare ``ValueError`` otherwise (the caller's message says what it expects).
    The one reading of a duration written as text: the variables and the routes file."""
    try:
        value = parse_duration(text)
    except ValueError:
        raise ValueError from None
    if not math.isfinite(value) or (value == 0 and not zero_ok):
        raise ValueError
    return value


HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""An HTTP header name (RFC 9110's token), as a variable or the routes file may give one."""


def _as_seconds(value: object) -> float | None:
    """``value`` as a finite float, or None when it is no number of seconds at all."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        seconds = float(value)
    except OverflowError:  # an int too large to be a float
        return None
    return seconds if math.isfinite(seconds) else None


@overload
def duration(
    name: str,
    value: object,
    *,
    allow_none: Literal[False] = False,
    allow_zero: bool = False,
    at_least: float = 0.0,
    also: str = "",
) -> float: ...


@overload
def duration(
    name: str,
    value: object,
    *,
    allow_none: Literal[True],
    allow_zero: bool = False,
    at_least: float = 0.0,
    also: str = "",
) -> float | None: ...


def duration(
    name: str,
    value: object,
    *,
    allow_none: bool = False,
    allow_zero: bool = False,
    at_least: float = 0.0,
    also: str = "",
) -> float | None:
    """``value`` as seconds (a float), checked: the one duration check of the package.

    ``value`` is an ``int``, a ``float`` or a :class:`~datetime.timedelta`. It must be
    finite and > 0; ``allow_zero`` admits 0 (where 0 means off), ``at_least`` raises the
    least value admitted, and ``allow_none`` admits None (returned as None). ``ValueError``
    otherwise, worded the same for every option: ``{name} must be a finite number of
    seconds > 0 (or a timedelta), got {value!r}``. ``also`` names what else the option takes,
    checked by its caller (``"or 'auto'"``), in the same sentence.
    """
    if value is None and allow_none:
        return None
    seconds = _as_seconds(value)
    if seconds is not None and (
        seconds > at_least or (seconds == at_least and (at_least > 0 or allow_zero))
    ):
        return seconds
    bound = f">= {at_least:g}" if at_least > 0 else ">= 0" if allow_zero else "> 0"
    more = (", or None" if allow_none else "") + (f", {also}" if also else "")
    raise ValueError(
        f"{name} must be a finite number of seconds {bound} (or a timedelta){more}, got {value!r}"
    )


@overload
def count(
    name: str, value: int, *, minimum: int = 1, allow_none: Literal[False] = False
) -> int: ...


@overload
def count(
    name: str, value: int | None, *, minimum: int = 1, allow_none: Literal[True]
) -> int | None: ...


def count(name: str, value: object, *, minimum: int = 1, allow_none: bool = False) -> int | None:
    """``value`` as an ``int`` >= ``minimum``, checked: the one count check of the package.

    A float with no fractional part (``8.0``) is taken as its whole number; ``bool``, any
    other float and anything else are refused: ``{name} must be a whole number >= 1,
    got {value!r}``. ``allow_none`` admits None (no limit).
    """
    if value is None and allow_none:
        return None
    whole: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        whole = value
    elif isinstance(value, float) and value.is_integer():
        whole = int(value)
    if whole is not None and whole >= minimum:
        return whole
    none = ", or None" if allow_none else ""
    raise ValueError(f"{name} must be a whole number >= {minimum}{none}, got {value!r}")
