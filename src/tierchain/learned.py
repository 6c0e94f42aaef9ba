"""A learned normal: each backend's own time to first data event sets its window.

``SaturationWatchdog(slow_after="auto")`` (or ``slow_after=Learned(...)``)
learns, per backend and per prompt-size bucket, how long that backend takes to
send its first data event when all is well, from the gateway's own successful
attempts (a :class:`~tierchain.sketch.LogSketch` each). The window for the next
attempt is the ``quantile`` of those times times ``margin``, clamped between
``floor`` and ``maximum``. Until a bucket has ``min_samples`` samples the
window is ``maximum``, the configured value (a cold start behaves exactly as a
fixed ``slow_after=maximum``).

Prompt-size buckets (estimated at 4 bytes per token): under 1k tokens, under
4k, under 16k, under 64k, and larger: a long prompt's prefill is not judged by
a short prompt's normal.

A model swap that makes first tokens slower would otherwise be cut by the old
normal forever (no attempt succeeds, so nothing new is learned): two
saturations in a row under a learned window forget that bucket, and the
backend is judged by ``maximum`` until it has enough samples again. Older
samples also fade (``half_life`` samples), so a faster model is learned too.

The window in force is exported as the ``tierchain_learned_slow_after_seconds``
gauge (per backend and bucket).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ._checks import count, duration
from .sketch import LogSketch
from .telemetry import LEARNED_SLOW_AFTER, LEARNED_STALL_AFTER, labelled, log_event

__all__ = ["BUCKETS", "Learned", "LearnedGap", "bucket_of"]

BUCKETS = ("1k", "4k", "16k", "64k", "more")
_LIMITS = (1_000, 4_000, 16_000, 64_000)
_FORGET_AFTER = 2  # saturations in a row under a learned window


def bucket_of(body: bytes | None) -> str:
    """The prompt-size bucket of a request body (4 bytes per token, estimated)."""
    tokens = len(body or b"") / 4
    for limit, name in zip(_LIMITS, BUCKETS, strict=False):
        if tokens < limit:
            return name
    return BUCKETS[-1]


@dataclass(slots=True)
class _Normal:
    sketch: LogSketch
    saturated: int = 0


@dataclass
class Learned:
    """Learn each backend's normal time to first data event; window = quantile x margin.

    ``maximum`` is the configured window: used until ``min_samples`` successful
    attempts were seen (per backend and prompt-size bucket), and never exceeded.
    ``floor`` is the least window ever used.
    """

    maximum: float = 30.0
    floor: float = 0.5
    quantile: float = 0.99
    margin: float = 2.0
    min_samples: int = 20
    half_life: float = 200.0
    _normals: dict[tuple[str, str], _Normal] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _gauge: ClassVar[Any] = LEARNED_SLOW_AFTER

    def __post_init__(self) -> None:
        # maximum and floor are durations (seconds, or a timedelta kept as seconds).
        self.maximum = duration("maximum", self.maximum)
        self.floor = duration("floor", self.floor)
        for name in ("margin", "half_life"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.floor > self.maximum:
            raise ValueError(f"floor ({self.floor}) must not exceed maximum ({self.maximum})")
        if not (0 < self.quantile < 1):
            raise ValueError(f"quantile must be in (0, 1), got {self.quantile!r}")
        self.min_samples = count("min_samples", self.min_samples)

    def _normal(self, backend: str, bucket: str) -> _Normal:
        key = (backend, bucket)
        normal = self._normals.get(key)
        if normal is None:
            normal = self._normals[key] = _Normal(LogSketch(half_life=self.half_life))
        return normal

    def window(self, backend: str, body: bytes | None) -> tuple[float, bool]:
        """The window for an attempt of ``backend`` with ``body``, and whether it was learned."""
        bucket = bucket_of(body)
        normal = self._normals.get((backend, bucket))
        if normal is None or normal.sketch.count < self.min_samples:
            return self.maximum, False
        q = normal.sketch.quantile(self.quantile)
        if q is None:  # pragma: no cover - count > 0 means a sample
            return self.maximum, False
        value = min(self.maximum, max(self.floor, q * self.margin))
        labelled(self._gauge, backend, bucket).set(value)
        return value, True

    def normal(self, backend: str, body: bytes | None) -> float | None:
        """The learned normal itself (the ``quantile``, no margin), or None until learned."""
        normal = self._normals.get((backend, bucket_of(body)))
        if normal is None or normal.sketch.count < self.min_samples:
            return None
        return normal.sketch.quantile(self.quantile)

    def observe(self, backend: str, body: bytes | None, first_data_s: float) -> None:
        """One successful attempt's time to its first data event."""
        normal = self._normal(backend, bucket_of(body))
        normal.sketch.add(first_data_s)
        normal.saturated = 0

    def saturated(self, backend: str, body: bytes | None, learned: bool) -> None:
        """An attempt was cut; under a learned window twice in a row, forget the bucket."""
        if not learned:
            return
        bucket = bucket_of(body)
        normal = self._normal(backend, bucket)
        normal.saturated += 1
        if normal.saturated >= _FORGET_AFTER:
            normal.sketch.reset()
            normal.saturated = 0
            labelled(self._gauge, backend, bucket).set(self.maximum)
            log_event("watchdog.normal_forgotten", backend=backend, bucket=bucket)


@dataclass
class LearnedGap(Learned):
    """Learn each backend's normal gap between data events; ``stall_after="auto"``.

    One sample per whole stream (an event stream or NDJSON lines): its mean gap
    between data events (the gateway does no per-event work to learn it). The
    stall window is the ``quantile`` of those gaps times ``margin``, between
    ``floor`` (2 s: a tower whose tokens come every 50 ms is cut 2 s into a
    stall) and ``maximum`` (120 s, the ceiling, used until ``min_samples``
    streams were seen: a cold start is as patient as the old fixed default).
    Exported as ``tierchain_learned_stall_after_seconds``. Not bucketed by
    prompt size: pass ``None`` as the body.
    """

    maximum: float = 120.0
    floor: float = 2.0
    quantile: float = 0.99
    margin: float = 10.0
    min_samples: int = 10
    _gauge: ClassVar[Any] = LEARNED_STALL_AFTER
