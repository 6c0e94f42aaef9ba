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
from .telemetry import (
    LEARNED_PROMPT_RATE,
    LEARNED_SLOW_AFTER,
    LEARNED_STALL_AFTER,
    labelled,
    log_event,
)

__all__ = ["BUCKETS", "Learned", "LearnedGap", "PromptRate", "bucket_of", "prompt_tokens"]

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


_RECOMPUTE_EVERY = 16  # samples between two computations of a learned window


@dataclass(slots=True)
class _Normal:
    sketch: LogSketch
    saturated: int = 0
    value: float = 0.0
    """The window last computed from the sketch (0: compute it again). A request reads
    it, not the sketch: the quantile is a walk over the sketch's 200 buckets, done once
    per ``_RECOMPUTE_EVERY`` samples (every sample while the sketch is young). Being one
    of the sketch's bucket edges times the margin, it recurs: the watchdog's timer for
    it waits in a queue of equal delays."""
    fresh: int = 0


@dataclass
class Learned:
    """Learn each backend's normal time to first data event; window = quantile x margin.

    ``maximum`` is the configured window: used until ``min_samples`` successful
    attempts were seen (per backend and prompt-size bucket), and never exceeded.
    ``floor`` is the least window ever used.

    Options: [the learned normal](watchdog.md#the-learned-normal-slow_afterauto).
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
        # bucket_of(body), inline (every attempt asks, and most prompts are under 1k tokens)
        tokens = len(body or b"") / 4
        bucket = BUCKETS[0] if tokens < _LIMITS[0] else bucket_of(body)
        normal = self._normals.get((backend, bucket))
        if normal is None or normal.sketch.count < self.min_samples:
            return self.maximum, False
        value = normal.value
        if not value:
            q = normal.sketch.quantile(self.quantile)
            if q is None:  # pragma: no cover - count > 0 means a sample
                return self.maximum, False
            value = normal.value = min(self.maximum, max(self.floor, q * self.margin))
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
        # bucket_of(body) and self._normal, inline as in window() (every success teaches)
        bucket = BUCKETS[0] if len(body or b"") / 4 < _LIMITS[0] else bucket_of(body)
        normal = self._normals.get((backend, bucket))
        if normal is None:
            normal = self._normal(backend, bucket)
        normal.sketch.add(first_data_s)
        normal.saturated = 0
        normal.fresh += 1
        if normal.fresh >= _RECOMPUTE_EVERY or normal.sketch.count < 4 * self.min_samples:
            normal.value = 0.0  # computed again by the next window()
            normal.fresh = 0

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
            normal.value = 0.0
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


# -- the prompt rate ----------------------------------------------------------

_REGIME_DEFAULTS: dict[str, tuple[float, float]] = {"local": (100.0, 10.0)}
"""Per regime, before anything is learned: (prompt tokens per second, least wait)."""
_OTHER_DEFAULT = (500.0, 30.0)
"""Any other regime (``hosted``, none, ...): a provider's queue is not ours to know."""
_LEASTS = frozenset(least for _, least in (*_REGIME_DEFAULTS.values(), _OTHER_DEFAULT))
_EW = 0.2  # the weight of a new sample in the running mean and variance of its log
_GAUGE_EVERY = 16  # rates learned between two updates of the exported gauge
_SPREAD = 2.0  # standard deviations below the mean rate (above the mean overhead)


def prompt_tokens(body: bytes | None) -> float:
    """The prompt size of ``body`` in tokens, from its bytes (4 a token, JSON included)."""
    return len(body or b"") / 4


@dataclass(slots=True)
class _Running:
    """A running mean and variance of log(value), recent samples weighing more."""

    n: int = 0
    mean: float = 0.0
    var: float = 0.0

    def add(self, value: float) -> None:
        x = math.log(value)
        self.n += 1
        if self.n == 1:
            self.mean, self.var = x, 0.0
            return
        delta = x - self.mean
        self.mean += _EW * delta
        self.var = (1 - _EW) * (self.var + _EW * delta * delta)

    def low(self) -> float:
        return math.exp(self.mean - _SPREAD * math.sqrt(self.var))

    def high(self) -> float:
        return math.exp(self.mean + _SPREAD * math.sqrt(self.var))


@dataclass(slots=True)
class _Rate:
    rate: _Running = field(default_factory=_Running)
    overhead: _Running = field(default_factory=_Running)


@dataclass
class PromptRate:
    """Each backend's normal prompt rate: how long a first token may take for this prompt.

    From the gateway's own healthy attempts (time to first data event, prompt
    size) it learns per backend a rate in prompt tokens per second (the slow
    end of its normal: the running mean of log(tokens / seconds) less two
    standard deviations) and, from prompts under ``min_tokens``, the fixed
    cost of a first token (the slow end likewise). The prompt size is estimated
    from the body's bytes, 4 a token, JSON included: no parse on the request
    path, and the same estimate teaches the rate and judges it, so its bias
    cancels out. A request whose expected prefill is over,

        limit = max(floor, margin * (overhead + tokens / rate))

    with no first token is ``too_slow``, whatever its status says. Until a
    backend has ``min_samples`` rates, its regime's built-in default applies
    (``local``: 100 tokens/s, at least 10 s; any other regime: 500 tokens/s,
    at least 30 s), so a 625-token prompt on an unlearned local tower waits
    12.5 s at most, and a 90k-token one 30 minutes (the ceiling cuts first).
    ``rate`` fixes the rate for every backend instead (nothing is learned).
    """

    margin: float = 2.0
    floor: float = 2.0
    """The least wait once a rate is learned (a first token has fixed costs)."""
    min_samples: int = 3
    min_tokens: int = 64
    """Prompts smaller than this teach the fixed cost, not the rate."""
    rate: float | None = None
    _rates: dict[str, _Rate] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("margin", "floor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.margin < 1:
            raise ValueError(f"margin must be a number >= 1, got {self.margin!r}")
        if self.rate is not None and not (
            isinstance(self.rate, int | float) and math.isfinite(self.rate) and self.rate > 0
        ):
            raise ValueError(f"rate must be a number of tokens per second > 0, got {self.rate!r}")
        self.min_samples = count("min_samples", self.min_samples)
        self.min_tokens = count("min_tokens", self.min_tokens)

    def recurs(self, seconds: float) -> bool:
        """True for a limit most requests share (a regime's least wait, or the floor):
        its timer can wait in a queue of equal delays instead of the heap."""
        return seconds == self.floor or seconds in _LEASTS

    def limit(self, backend: str, regime: str | None, body: bytes | None) -> tuple[float, bool]:
        """Seconds a first token may take for ``body`` at ``backend``, and whether learned."""
        tokens = len(body or b"") / 4  # prompt_tokens(body), inline: every attempt asks
        if self.rate is not None:
            return max(self.floor, self.margin * tokens / self.rate), False
        known = self._rates.get(backend)
        if known is None or known.rate.n < self.min_samples:
            rate, least = _REGIME_DEFAULTS.get(regime or "", _OTHER_DEFAULT)
            overhead = 0.0
            if known is not None and known.overhead.n >= self.min_samples:
                overhead = known.overhead.high()
            limit = self.margin * (overhead + tokens / rate)
            return (limit if limit > least else least), False  # (max(), with no call)
        overhead = known.overhead.high() if known.overhead.n >= self.min_samples else 0.0
        return max(self.floor, self.margin * (overhead + tokens / known.rate.low())), True

    def observe(self, backend: str, body: bytes | None, first_data_s: float) -> None:
        """One healthy attempt's time to its first data event."""
        if self.rate is not None or not (first_data_s > 0 and math.isfinite(first_data_s)):
            return
        known = self._rates.get(backend)
        if known is None:
            known = self._rates[backend] = _Rate()
        tokens = prompt_tokens(body)
        if tokens < self.min_tokens:
            known.overhead.add(first_data_s)
        else:
            known.rate.add(tokens / first_data_s)
            n = known.rate.n - self.min_samples
            if n >= 0 and n % _GAUGE_EVERY == 0:  # (the healthy path pays for no more)
                labelled(LEARNED_PROMPT_RATE, backend).set(known.rate.low())

    def rate_for(self, backend: str, regime: str | None) -> float:
        """The rate a prefill at ``backend`` is judged by: learned, fixed, or its regime's."""
        if self.rate is not None:
            return self.rate
        known = self._rates.get(backend)
        if known is None or known.rate.n < self.min_samples:
            return _REGIME_DEFAULTS.get(regime or "", _OTHER_DEFAULT)[0]
        return known.rate.low()

    def normal_rate(self, backend: str) -> float | None:
        """The learned rate in tokens per second (its slow end), or None until learned."""
        known = self._rates.get(backend)
        if self.rate is not None:
            return self.rate
        if known is None or known.rate.n < self.min_samples:
            return None
        return known.rate.low()
