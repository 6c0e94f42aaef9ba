"""The suspect marks' rule: a backend a verdict marked, and who may try it again.

:func:`check_mark` is :meth:`~tierchain.store.NormalStore.suspect_check` on a dict of marks
(:class:`~tierchain.MemoryStore` runs it; :class:`~tierchain.RedisStore` runs its Lua copy).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SUSPECT_KEEP", "Suspect", "check_mark"]


@dataclass(frozen=True, slots=True)
class Suspect:
    """A backend a caller's attempt was judged on (too slow, stalled, broke mid-stream).

    ``why`` is the verdict; ``retry_in`` the seconds until one caller may try it again
    (0 for that caller: ``probe`` is True, and only it goes until its verdict); ``strikes``
    counts the verdicts in a row (the Breaker's ledgers, not the mark, grow the wait).
    """

    why: str
    retry_in: float
    probe: bool = False
    strikes: int = 1


SUSPECT_KEEP = 600.0
"""Seconds a suspect mark's strikes are remembered after its hold ended, with no verdict."""


@dataclass(slots=True)
class _Mark:
    until: float
    why: str
    strikes: int = 1
    probe_until: float = 0.0


def check_mark(marks: dict[str, _Mark], backend: str, now: float, lease: float) -> Suspect | None:
    """:meth:`~tierchain.store.NormalStore.suspect_check` on a dict of marks (RedisStore runs
    it in Lua)."""
    mark = marks.get(backend)
    if mark is None:
        return None
    if now >= mark.until + SUSPECT_KEEP:
        del marks[backend]
        return None
    if now < mark.until:
        return Suspect(mark.why, mark.until - now, False, mark.strikes)
    if mark.probe_until > now:
        return Suspect(mark.why, mark.probe_until - now, False, mark.strikes)
    mark.probe_until = now + lease
    return Suspect(mark.why, 0.0, True, mark.strikes)
