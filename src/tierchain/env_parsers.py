"""The parsers of the ``TIERCHAIN_*`` variables: a variable's text made a value.

A parser takes the raw string and returns the value, or raises ValueError; the problem message
is built from the :class:`~tierchain.config.Option`'s ``expected`` (plus the error's text,
when it has any). Durations go through the one grammar of :mod:`tierchain._checks`
(``text_seconds``). The table that names a parser per variable is :mod:`tierchain.options`.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from ._checks import HEADER_NAME, text_seconds
from .backend import BACKEND_NAME

__all__ = [
    "STACK_ORDER",
    "Parser",
    "backend_name",
    "boolean",
    "choice",
    "count_or_none",
    "fraction",
    "header_name",
    "import_path",
    "integer",
    "mount_path",
    "name_list",
    "number_above_zero",
    "origin_list",
    "path_list",
    "pick_weights",
    "prompt_rate",
    "seconds",
    "size",
    "slow_after",
    "slow_after_or_auto",
    "stack_list",
    "status_list",
    "store_url",
    "text",
    "token",
]

Parser = Callable[[str], Any]

_SIZE = re.compile(r"([0-9]+)\s*(b|k|kb|kib|m|mb|mib|g|gb|gib)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_NONE_WORDS = frozenset({"", "none", "off", "no"})


STACK_ORDER = (
    "Heartbeats",
    "Budget",
    "PreferBackend",
    "Failover",
    "Breaker",
    "SaturationWatchdog",
)
"""The middlewares ``tierchain serve`` can stack, outermost first (``TIERCHAIN_STACK``
lists some of them in this order)."""


def seconds(*, zero_ok: bool = True, optional: bool = False) -> Parser:
    """Seconds as ``30``, ``2.5``, ``250ms``, ``15m``, ``2h`` (the package's one text grammar
    for durations, :func:`tierchain._checks.parse_duration`); ``none`` too when optional."""

    def parse(raw: str) -> float | None:
        if optional and raw.strip().lower() in _NONE_WORDS:
            return None
        return text_seconds(raw, zero_ok=zero_ok)

    return parse


def integer(minimum: int, maximum: int | None = None) -> Parser:
    """A whole number in [minimum, maximum]."""

    def parse(raw: str) -> int:
        value = int(raw.strip(), 10)
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError
        return value

    return parse


def count_or_none(raw: str) -> int | None:
    """A whole number >= 1, or ``none`` (no limit)."""
    if raw.strip().lower() in _NONE_WORDS:
        return None
    value: int = integer(1)(raw)
    return value


def fraction(raw: str) -> float:
    """A number in (0, 1], such as ``0.8``."""
    value = float(raw.strip())
    if not (math.isfinite(value) and 0 < value <= 1):
        raise ValueError
    return value


def number_above_zero(raw: str) -> float:
    """A finite number > 0, such as ``2`` or ``1.5``."""
    value = float(raw.strip())
    if not (math.isfinite(value) and value > 0):
        raise ValueError
    return value


def size(raw: str) -> int:
    """Bytes as ``33554432``, ``512k``, ``32MiB``, ``1g`` (binary multiples)."""
    match = _SIZE.fullmatch(raw.strip())
    if match is None:
        raise ValueError
    unit = (match[2] or "").lower()[:1]
    return int(match[1]) * _SIZE_UNITS[unit]


def boolean(raw: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off``."""
    text = raw.strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off"}:
        return False
    raise ValueError


def header_name(raw: str) -> str:
    """An HTTP header name such as ``X-Request-Timeout``."""
    text = raw.strip()
    if not HEADER_NAME.fullmatch(text):
        raise ValueError
    return text


def name_list(raw: str) -> tuple[str, ...]:
    """Names separated by commas: ``high,normal,low``."""
    names = tuple(p.strip() for p in raw.split(",") if p.strip())
    if not names or len({n.lower() for n in names}) != len(names):
        raise ValueError
    return names


def text(raw: str) -> str:
    """Any non-empty text."""
    if not raw.strip():
        raise ValueError
    return raw.strip()


def status_list(raw: str) -> frozenset[int]:
    """HTTP statuses separated by commas: ``429,500,502``."""
    values = [p.strip() for p in raw.split(",") if p.strip()]
    statuses = frozenset(int(v, 10) for v in values)
    if not all(100 <= s <= 599 for s in statuses):
        raise ValueError
    return statuses


def choice(*choices: str) -> Parser:
    """One of ``choices`` (case-insensitive)."""

    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError
        return value

    return parse


def backend_name(raw: str) -> str:
    """A backend name: 1-64 characters from ``A-Z a-z 0-9 . _ -``."""
    if not BACKEND_NAME.fullmatch(raw.strip()):
        raise ValueError
    return raw.strip()


def token(raw: str) -> str:
    """A secret of 16 to 512 printable ASCII characters, no spaces."""
    if not re.fullmatch(r"[\x21-\x7e]{16,512}", raw):
        raise ValueError
    return raw


def pick_weights(raw: str) -> Any:
    """Pick weights as ``name=number`` pairs separated by commas:
    ``in_flight=1,waiting=1,kv_cache=2,slots=1,first_data=0.1`` (a name left out
    keeps its default)."""
    from .picker import PickWeights  # (the picker's own check, imported when used)

    values: dict[str, float] = {}
    for part in raw.split(","):
        if not part.strip():
            continue
        name, eq, number = part.partition("=")
        if not eq:
            raise ValueError
        values[name.strip()] = float(number.strip())
    try:
        return PickWeights(**values)
    except TypeError:  # a name that is not a weight
        raise ValueError from None


def import_path(raw: str) -> str:
    """An import path ``package.module:name`` of something that can be imported now (so that
    ``check-config`` finds a typo; the layer imports it again when it is built)."""
    text = raw.strip()
    if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", text):
        raise ValueError
    module, _, name = text.partition(":")
    try:
        getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot be imported: {exc}") from None
    return text


def path_list(raw: str) -> tuple[str, ...]:
    """URL path prefixes separated by commas, each starting with ``/``."""
    paths = tuple(p.strip() for p in raw.split(",") if p.strip())
    if not paths or not all(p.startswith("/") for p in paths):
        raise ValueError
    return paths


def origin_list(raw: str) -> tuple[str, ...]:
    """Origins separated by commas: ``https://ops.example,https://other.example``."""
    origins = tuple(p.strip() for p in raw.split(",") if p.strip())
    for origin in origins:
        parts = urlsplit(origin)
        if parts.scheme not in {"http", "https"} or not parts.netloc or parts.path:
            raise ValueError(f"{origin!r} is not an origin")
    return origins


def mount_path(raw: str) -> str:
    """A path prefix such as ``/admin/tierchain`` (no trailing slash)."""
    path = raw.strip().rstrip("/")
    if not path.startswith("/") or any(c in path for c in "?# "):
        raise ValueError
    return path


def stack_list(raw: str) -> tuple[str, ...]:
    """Middleware names separated by commas, in the fixed order (outermost first)."""
    names: list[str] = []
    by_lower = {n.lower(): n for n in STACK_ORDER}
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        name = by_lower.get(part.lower())
        if name is None:
            raise ValueError(f"{part!r} is not one of {', '.join(STACK_ORDER)}")
        if name in names:
            raise ValueError(f"{name} is listed twice")
        names.append(name)
    order = [n for n in STACK_ORDER if n in names]
    if names != order:
        raise ValueError(f"the order is fixed, outermost first: list them as {','.join(order)}")
    return tuple(names)


def store_url(raw: str) -> str:
    """``memory://`` or a redis URL (``redis://``, ``rediss://``, ``unix://``)."""
    url = raw.strip()
    parts = urlsplit(url)
    if url in {"memory", "memory://"}:
        return "memory://"
    if parts.scheme in {"redis", "rediss"} and parts.hostname:
        return url
    if parts.scheme == "unix" and parts.path:
        return url
    raise ValueError


_ALLOWANCE = "allowance"
_AUTO = "auto"


def slow_after(raw: str) -> float | str:
    """Seconds (0: off), ``allowance`` (TIERCHAIN_ALLOWANCE_*) or ``auto`` (TIERCHAIN_LEARNED_*)."""
    if raw.strip().lower() == _ALLOWANCE:
        return _ALLOWANCE
    if raw.strip().lower() == _AUTO:
        return _AUTO
    value: float = seconds(zero_ok=True)(raw)
    return value


def slow_after_or_auto(raw: str) -> float | str:
    """Seconds, or the word ``auto``."""
    if raw.strip().lower() == _AUTO:
        return _AUTO
    value: float = seconds(zero_ok=True)(raw)
    return value


def prompt_rate(raw: str) -> float | str:
    """``auto`` (learned per backend), a rate in prompt tokens per second, or 0 (off)."""
    if raw.strip().lower() == _AUTO:
        return _AUTO
    value = float(raw.strip())
    if not (math.isfinite(value) and value >= 0):
        raise ValueError
    return value
