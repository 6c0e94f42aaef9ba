"""The sliding windows' arithmetic: a counter kept in :data:`WINDOW_BUCKETS` buckets.

What a per-key limit asks of a store (:class:`WindowCheck`, answered by a
:class:`WindowHold`), whether a counter refuses a check (:func:`refuses`), and a window's
sum and the time until it has room (:func:`window_sum`, :func:`room_in`).
:class:`~tierchain.MemoryStore` counts with these; :class:`~tierchain.RedisStore` runs the
same arithmetic in Lua (:mod:`tierchain.redis_scripts`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "USAGE_BOUND",
    "WINDOW_BUCKETS",
    "WindowCheck",
    "WindowHold",
    "refuses",
    "room_in",
    "window_sum",
]

WINDOW_BUCKETS = 60
"""A windowed counter keeps its window in this many buckets: a window of 60 s counts per
second, a day's in 24-minute buckets; an amount leaves the window with its bucket."""


USAGE_BOUND = 2**31
"""The most any one amount a store is given may be (tokens of one request, a cost in
nano-units): :mod:`tierchain.limits` bounds every number from outside (an upstream's usage,
a caller's ``max_tokens``) to it before it is stored. No model's context holds a
thousandth of it, and sums of such amounts stay exact in Lua's doubles (2^53) and in
Redis's 64-bit integers for millions of requests per bucket."""


@dataclass(frozen=True, slots=True)
class WindowCheck:
    """One limit to check on admission: the counter ``name`` summed over the last
    ``window`` seconds must stay within ``limit`` once ``cost`` is added (with
    ``cost`` 0: must be below ``limit``). With ``fits`` False the counter must only
    be below ``limit`` and the cost may take it past: a reservation, where the
    request admitted last may overrun the limit by its own amount, never more."""

    name: str
    window: float
    limit: int
    cost: int = 0
    fits: bool = True


@dataclass(frozen=True, slots=True)
class WindowHold:
    """The answer of :meth:`UsageStore.window_hold`.

    ``refused``: None when every check passed and the costs were added, else the
    seconds until the failing counters have room and the index of the check that
    needs the longest. ``at``: the store's time the costs were added at (hand it
    back to :meth:`UsageStore.usage_record` as ``released`` to take them out of
    their own bucket). ``used``: each counter's sum now (after the costs, when
    added); ``reset``: the seconds until each counter's oldest amount leaves its
    window (the window's length when it holds nothing).
    """

    refused: tuple[float, int] | None
    at: float
    used: tuple[int, ...]
    reset: tuple[float, ...]


def refuses(check: WindowCheck, total: int) -> bool:
    """Does a counter that holds ``total`` refuse ``check``?"""
    if check.cost and check.fits:
        return total + check.cost > check.limit
    return total >= check.limit


def _bucket_of(now: float, window: float) -> int:
    return int(now // (window / WINDOW_BUCKETS))


def window_sum(buckets: dict[int, int], now: float, window: float) -> tuple[int, int | None]:
    """Drop the buckets that left ``window``; the sum of the rest, and the oldest non-empty one."""
    oldest = _bucket_of(now, window) - WINDOW_BUCKETS + 1
    total = 0
    first: int | None = None
    for bucket in [b for b in buckets if b < oldest]:
        del buckets[bucket]
    for bucket, amount in buckets.items():
        total += amount
        if amount and (first is None or bucket < first):
            first = bucket
    return total, first


def room_in(first: int | None, now: float, window: float) -> float:
    """Seconds until the oldest non-empty bucket ``first`` leaves the window."""
    if first is None:
        return window
    width = window / WINDOW_BUCKETS
    return max(0.001, (first + WINDOW_BUCKETS) * width - now)
