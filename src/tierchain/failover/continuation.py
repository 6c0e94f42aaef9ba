"""Continuation: finish a broken answer on the next tier, in the caller's own stream.

When a committed stream breaks, stalls or is cut, Failover (``continuing.py`` here)
asks :func:`seam` for the seam of the answer the caller has: the request's wire format
builds it (``WireFormat.seam``, in the format's own module of :mod:`tierchain.formats`:
its events parsed once, the next tier's request, its events rewritten into the first
tier's envelope, the stream's own end at the caller's limit). What every format's seam
shares (the repeat cut at the seam, the token limits, :data:`INSTRUCTION`) is
:mod:`tierchain.formats.seam`.

Nothing here does I/O: Failover drives it.
"""

from __future__ import annotations

from ..formats import of
from ..formats.seam import INSTRUCTION, LIMIT_KEYS, Seam

__all__ = ["INSTRUCTION", "LIMIT_KEYS", "Seam", "seam"]


def seam(wire: str | None, origin: str, sent: bytes, *, ndjson: bool) -> Seam:
    """The seam of an answer in ``wire`` whose events ``sent`` reached the caller from
    ``origin``; check :attr:`Seam.ok` before continuing it."""
    return of(wire).seam(origin, sent, ndjson=ndjson)
