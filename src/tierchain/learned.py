"""A learned normal: each backend's own time to first data event sets its window.

``SaturationWatchdog(slow_after="auto")`` (or ``slow_after=Learned(...)``)
learns, per backend and per prompt-size bucket, how long that backend takes to
send its first data event when all is well, from the gateway's own successful
attempts (a :class:`~tierchain.sketch.LogSketch` each). The window for the next
attempt is the ``quantile`` of those times times ``margin``, clamped between
``floor`` and ``maximum``. Until a bucket has ``min_samples`` samples the
window is ``maximum``, the configured value (a cold start behaves exactly as a
fixed ``slow_after=maximum``).

Prompt-size buckets (estimated at :data:`BYTES_PER_TOKEN` bytes per token): under
1k tokens, under 4k, under 16k, under 64k, and larger: a long prompt's prefill is
not judged by a short prompt's normal.

Until a backend's normal is learned it is judged by its regime's cold default
(:data:`COLD`, :func:`cold`), sized for an outage, never by the ceiling.
:class:`SharedNormals` keeps every learned value in the store (a
:class:`~tierchain.MemoryStore`, or a :class:`~tierchain.RedisStore` shared by
replicas), read at an attempt's start and written after its end, so a restarted
gateway or a second replica judges its first request as the warm one would.

A model swap that makes first tokens slower would otherwise be cut by the old
normal forever (no attempt succeeds, so nothing new is learned): two
saturations in a row under a learned window forget that bucket, and the
backend is judged by ``maximum`` until it has enough samples again. Older
samples also fade (``half_life`` samples), so a faster model is learned too.

The window in force is exported as the ``tierchain_learned_slow_after_seconds``
gauge (per backend and bucket).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from ._checks import count, duration
from ._runtime import clock
from .sketch import LogSketch
from .telemetry import (
    LEARNED_BYTES_PER_TOKEN,
    LEARNED_DECODE_RATE,
    LEARNED_PROMPT_RATE,
    LEARNED_SLOW_AFTER,
    LEARNED_STALL_AFTER,
    labelled,
    log_event,
)

__all__ = [
    "BUCKETS",
    "BYTES_PER_TOKEN",
    "COLD",
    "Cold",
    "DecodeRate",
    "Learned",
    "LearnedGap",
    "PromptRate",
    "SharedNormals",
    "bucket_of",
    "cold",
    "prompt_tokens",
]

BYTES_PER_TOKEN = 4.0
"""The one rule for a prompt's size before a backend's answers said better: a token
per 4 bytes of the request body, JSON included. Every estimate in the package starts
here; :meth:`PromptRate.tokens` replaces it per backend once its answers reported
their usage."""


def prompt_tokens(body: bytes | None, bytes_per_token: float = BYTES_PER_TOKEN) -> float:
    """The prompt size of ``body`` in tokens, from its bytes (:data:`BYTES_PER_TOKEN` a
    token, JSON included, unless ``bytes_per_token`` says otherwise)."""
    return len(body or b"") / bytes_per_token


@dataclass(frozen=True, slots=True)
class Cold:
    """What a backend is judged by until its normal is learned: sized for an outage.

    ``prompt_rate`` (prompt tokens per second) and ``first_token`` (the least wait for
    a first token) bound the first token (:class:`PromptRate`); ``stall`` bounds a gap
    between data events on a tier with a later tier (:class:`LearnedGap`; the last tier
    waits ``stall_ceiling``); ``decode`` is the least decode rate (tokens a second once
    generating) a committed stream with a later tier keeps (:class:`DecodeRate`).
    """

    prompt_rate: float
    first_token: float
    stall: float
    decode: float = 1.0


COLD: Mapping[str, Cold] = {
    "local": Cold(prompt_rate=100.0, first_token=10.0, stall=8.0, decode=2.0)
}
"""Per regime, before anything is learned. A local server streams a token every few
tens of milliseconds and pauses for seconds at most (another slot's prompt batch):
8 s of silence is an outage, and the next tier finishes the answer within 10 s. Under
2 tokens a second (a GPU taken by a game writes one every 0.2 to 0.9 s) it is starved."""
COLD_OTHER = Cold(prompt_rate=500.0, first_token=30.0, stall=30.0, decode=1.0)
"""Any other regime (``hosted``, none, ...): a provider's queue is not ours to know."""


def cold(regime: str | None) -> Cold:
    """The cold defaults of ``regime`` (:data:`COLD`, else :data:`COLD_OTHER`)."""
    return COLD.get(regime or "", COLD_OTHER)


BUCKETS = ("1k", "4k", "16k", "64k", "more")
_LIMITS = (1_000, 4_000, 16_000, 64_000)
_SMALL = _LIMITS[0] * BYTES_PER_TOKEN  # the bytes of the first bucket's prompts
_FORGET_AFTER = 2  # saturations in a row under a learned window


def bucket_of(body: bytes | None) -> str:
    """The prompt-size bucket of a request body (:func:`prompt_tokens`, estimated)."""
    if len(body or b"") < _SMALL:  # (most prompts: no division, no loop)
        return BUCKETS[0]
    tokens = prompt_tokens(body)
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
        return self._window(backend, bucket_of(body))

    def _window(self, backend: str, bucket: str) -> tuple[float, bool]:
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
        normal = self._normal(backend, bucket_of(body))
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

    def export(self, backend: str) -> dict[str, Any]:
        """``backend``'s learned samples as JSON values (see :class:`SharedNormals`)."""
        out: dict[str, Any] = {}
        for bucket in BUCKETS:
            normal = self._normals.get((backend, bucket))
            if normal is not None and normal.sketch.count:
                out[bucket] = normal.sketch.state()
        return out

    def adopt(self, backend: str, state: Mapping[str, Any]) -> None:
        """Take ``backend``'s samples from ``state`` (another process's :meth:`export`)."""
        for bucket in BUCKETS:
            got = state.get(bucket)
            normal = self._normals.get((backend, bucket))
            if got is None and normal is None:
                continue
            normal = self._normal(backend, bucket)
            if isinstance(got, dict):
                normal.sketch.load(got)
            else:
                normal.sketch.reset()
            normal.value = 0.0
            normal.fresh = 0


@dataclass
class LearnedGap(Learned):
    """Learn each backend's normal gap between data events; ``stall_after="auto"``.

    One sample per whole stream (an event stream or NDJSON lines): its mean gap
    between data events (the gateway does no per-event work to learn it). The
    stall window is the ``quantile`` of those gaps times ``margin``, between
    ``floor`` (2 s: a tower whose tokens come every 50 ms is cut 2 s into a
    stall) and ``maximum`` (120 s, the ceiling). Until ``min_samples`` streams
    were seen, :meth:`window_for` gives the regime's cold default
    (:data:`COLD`: 8 s for a local backend, 30 s otherwise, never above
    ``maximum``). Exported as ``tierchain_learned_stall_after_seconds``. Not
    bucketed by prompt size: pass ``None`` as the body.
    """

    maximum: float = 120.0
    floor: float = 2.0
    quantile: float = 0.99
    margin: float = 10.0
    min_samples: int = 10
    _gauge: ClassVar[Any] = LEARNED_STALL_AFTER

    def window_for(
        self, backend: str, regime: str | None, defaults: Cold | None = None
    ) -> tuple[float, bool]:
        """The stall window of ``backend``, and whether it was learned: until then its
        regime's cold default (:func:`cold`; ``defaults``: the caller's, already found),
        at most ``maximum``."""
        window, learned = self._window(backend, BUCKETS[0])  # (a gap has no prompt size)
        if learned:
            return window, True
        stall = (defaults or cold(regime)).stall
        return (stall if stall < window else window), False


# -- the prompt rate ----------------------------------------------------------

_LEASTS = frozenset(c.first_token for c in (*COLD.values(), COLD_OTHER))
_EW = 0.2  # the weight of a new sample in the running mean and variance of its log
_GAUGE_EVERY = 16  # rates learned between two updates of the exported gauge
_SPREAD = 2.0  # standard deviations below the mean rate (above the mean overhead)
_CALIBRATE_EVERY = 16  # answers whose usage is read in a row at most; then one in this many


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

    def state(self) -> list[float]:
        return [self.n, self.mean, self.var]

    def load(self, state: Any) -> None:
        n, mean, var = state  # a malformed state raises ValueError or TypeError
        if not (isinstance(n, int) and n >= 0 and math.isfinite(mean) and var >= 0):
            raise ValueError("not a running mean")
        self.n, self.mean, self.var = n, float(mean), float(var)


@dataclass(slots=True)
class _Rate:
    rate: _Running = field(default_factory=_Running)
    overhead: _Running = field(default_factory=_Running)
    size: _Running = field(default_factory=_Running)
    """Bytes of request body per prompt token, from the usage the answers reported."""
    bytes_per_token: float = BYTES_PER_TOKEN


@dataclass
class PromptRate:
    """Each backend's normal prompt rate: how long a first token may take for this prompt.

    From the gateway's own healthy attempts (time to first data event, prompt
    size) it learns per backend a rate in prompt tokens per second (the slow
    end of its normal: the running mean of log(tokens / seconds) less two
    standard deviations) and, from prompts under ``min_tokens``, the fixed
    cost of a first token (the slow end likewise). The prompt size is estimated
    from the body's bytes (no parse on the request path): :data:`BYTES_PER_TOKEN`
    a token until the backend's answers reported their usage, then the bytes
    per token those answers showed (:meth:`calibrate`, its running mean). A
    request whose expected prefill is over,

        limit = max(floor, margin * (overhead + tokens / rate))

    with no first token is ``too_slow``, whatever its status says. Until a
    backend has ``min_samples`` rates, its regime's cold default applies
    (:data:`COLD`: ``local`` 100 tokens/s, at least 10 s; any other regime: 500
    tokens/s, at least 30 s), so a 625-token prompt on an unlearned local tower
    waits 12.5 s at most, and a 90k-token one 30 minutes (the ceiling cuts first).
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
    _answers: dict[str, int] = field(  # per backend: healthy answers seen (calibrating)
        default_factory=dict, init=False, repr=False, compare=False
    )

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

    def limit(
        self, backend: str, regime: str | None, body: bytes | None, defaults: Cold | None = None
    ) -> tuple[float, bool]:
        """Seconds a first token may take for ``body`` at ``backend``, and whether learned
        (``defaults``: the regime's cold defaults, :func:`cold`, when the caller has them)."""
        known = self._rates.get(backend)
        tokens = prompt_tokens(body, known.bytes_per_token if known else BYTES_PER_TOKEN)
        if self.rate is not None:
            return max(self.floor, self.margin * tokens / self.rate), False
        if known is None or known.rate.n < self.min_samples:
            if defaults is None:
                defaults = cold(regime)
            least = defaults.first_token
            overhead = 0.0
            if known is not None and known.overhead.n >= self.min_samples:
                overhead = known.overhead.high()
            limit = self.margin * (overhead + tokens / defaults.prompt_rate)
            return (limit if limit > least else least), False  # (max(), with no call)
        overhead = known.overhead.high() if known.overhead.n >= self.min_samples else 0.0
        return max(self.floor, self.margin * (overhead + tokens / known.rate.low())), True

    def tokens(self, backend: str, body: bytes | None) -> float:
        """The prompt size of ``body`` in tokens at ``backend``: its bytes over the bytes
        per token that backend's answers reported (:data:`BYTES_PER_TOKEN` until then)."""
        known = self._rates.get(backend)
        return prompt_tokens(body, known.bytes_per_token if known is not None else BYTES_PER_TOKEN)

    def calibrate(self, backend: str, body: bytes | None, reported: int | None) -> None:
        """The answer to ``body`` reported ``reported`` prompt tokens: learn the bytes per
        token of ``backend``'s prompts (a running mean of its log)."""
        size = len(body or b"")
        if reported is None or reported < self.min_tokens or size < reported:
            return  # (a prompt served from a cache reports fewer tokens than it has)
        known = self._rates.get(backend)
        if known is None:
            known = self._rates[backend] = _Rate()
        known.size.add(size / reported)
        known.bytes_per_token = math.exp(known.size.mean)
        labelled(LEARNED_BYTES_PER_TOKEN, backend).set(known.bytes_per_token)

    def calibrating(self, backend: str) -> bool:
        """Whether this healthy answer's usage is to be read (the answer is counted).

        Every answer's, until ``backend``'s bytes per token is calibrated (``min_samples``
        answers reported their usage), for its first ``_CALIBRATE_EVERY`` answers at
        most; after that one answer's in ``_CALIBRATE_EVERY``: the ratio drifts only
        with the prompts, and a backend whose answers report no usage (a stream asked
        without ``stream_options.include_usage``) would otherwise be read in vain at
        the end of every attempt."""
        if self.rate is not None:
            return False
        answers = self._answers[backend] = self._answers.get(backend, 0) + 1
        known = self._rates.get(backend)
        if answers <= _CALIBRATE_EVERY and (known is None or known.size.n < self.min_samples):
            return True
        return answers % _CALIBRATE_EVERY == 0

    def observe(self, backend: str, body: bytes | None, first_data_s: float) -> None:
        """One healthy attempt's time to its first data event."""
        if self.rate is not None or not (first_data_s > 0 and math.isfinite(first_data_s)):
            return
        known = self._rates.get(backend)
        if known is None:
            known = self._rates[backend] = _Rate()
        tokens = prompt_tokens(body, known.bytes_per_token)
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
            return cold(regime).prompt_rate
        return known.rate.low()

    def normal_rate(self, backend: str) -> float | None:
        """The learned rate in tokens per second (its slow end), or None until learned."""
        known = self._rates.get(backend)
        if self.rate is not None:
            return self.rate
        if known is None or known.rate.n < self.min_samples:
            return None
        return known.rate.low()

    def export(self, backend: str) -> dict[str, Any]:
        """``backend``'s learned rate, fixed cost and bytes per token as JSON values."""
        known = self._rates.get(backend)
        if known is None:
            return {}
        return {"r": known.rate.state(), "o": known.overhead.state(), "b": known.size.state()}

    def adopt(self, backend: str, state: Mapping[str, Any]) -> None:
        """Take ``backend``'s learned values from ``state`` (another process's :meth:`export`)."""
        if not state:
            return
        known = _Rate()
        known.rate.load(state["r"])
        known.overhead.load(state["o"])
        known.size.load(state["b"])
        if known.size.n:
            known.bytes_per_token = math.exp(known.size.mean)
            labelled(LEARNED_BYTES_PER_TOKEN, backend).set(known.bytes_per_token)
        self._rates[backend] = known
        if known.rate.n >= self.min_samples:
            labelled(LEARNED_PROMPT_RATE, backend).set(known.rate.low())


# -- the decode rate -----------------------------------------------------------


@dataclass
class DecodeRate:
    """Each backend's normal decode rate: tokens a second once it is generating.

    Learned like the first-token time, from the gateway's own healthy streams (one
    sample a stream of at least ``min_events`` data events: events after the first over
    the seconds from the first to the last, an event being about a token on llama.cpp,
    vLLM and Ollama), as a running mean and variance of its logarithm. A committed
    stream on a tier with a later tier whose rate stays, over two ``span`` seconds in a
    row, below

        limit = fraction x (the slow end of the learned rate: its mean less two
                standard deviations)

    is starved (:mod:`tierchain.decode`). Until a backend has ``min_samples`` streams,
    its regime's cold default (:attr:`Cold.decode`: ``local`` 2 tokens/s, any other
    regime 1) is the limit. ``rate`` fixes the normal for every backend (nothing is
    learned). Exported as ``tierchain_learned_decode_rate{backend}``.
    """

    fraction: float = 0.25
    span: float = 2.0
    min_samples: int = 5
    min_events: int = 8
    rate: float | None = None
    _rates: dict[str, _Running] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (
            isinstance(self.fraction, int | float)
            and not isinstance(self.fraction, bool)
            and 0 < self.fraction < 1
        ):
            raise ValueError(f"slow_decode must be a fraction in (0, 1), got {self.fraction!r}")
        self.span = duration("decode_span", self.span)
        if self.rate is not None and not (
            isinstance(self.rate, int | float) and math.isfinite(self.rate) and self.rate > 0
        ):
            raise ValueError(f"rate must be a number of tokens per second > 0, got {self.rate!r}")
        self.min_samples = count("min_samples", self.min_samples)
        self.min_events = count("min_events", self.min_events, minimum=2)

    def observe(self, backend: str, events: int, seconds: float) -> bool:
        """One healthy stream: ``events`` data events over ``seconds`` from its first to
        its last. True when it taught something."""
        if self.rate is not None or events < self.min_events or not seconds > 0:
            return False
        known = self._rates.get(backend)
        if known is None:
            known = self._rates[backend] = _Running()
        known.add((events - 1) / seconds)
        if known.n >= self.min_samples and (known.n - self.min_samples) % _GAUGE_EVERY == 0:
            labelled(LEARNED_DECODE_RATE, backend).set(known.low())
        return True

    def normal(self, backend: str) -> float | None:
        """The normal decode rate in tokens a second (its slow end), or None until learned."""
        if self.rate is not None:
            return self.rate
        known = self._rates.get(backend)
        if known is None or known.n < self.min_samples:
            return None
        return known.low()

    def limit(self, backend: str, regime: str | None) -> tuple[float, bool]:
        """The least rate a committed stream at ``backend`` keeps, and whether learned."""
        normal = self.normal(backend)
        if normal is None:
            return cold(regime).decode, False
        return self.fraction * normal, True

    def export(self, backend: str) -> dict[str, Any]:
        """``backend``'s learned rate as JSON values (see :class:`SharedNormals`)."""
        known = self._rates.get(backend)
        return {} if known is None else {"d": known.state()}

    def adopt(self, backend: str, state: Mapping[str, Any]) -> None:
        """Take ``backend``'s learned rate from ``state`` (another process's :meth:`export`)."""
        if not state:
            return
        known = _Running()
        known.load(state["d"])
        self._rates[backend] = known


# -- shared through the store ------------------------------------------------------


class _Normals(Protocol):
    """What :class:`SharedNormals` needs of a store (see :class:`tierchain.store.NormalStore`)."""

    async def normals_get(self, backend: str) -> str | None: ...

    async def normals_put(self, backend: str, value: str, ttl: float) -> None: ...


class _Part(Protocol):
    """A value learned per backend (:class:`Learned`, :class:`LearnedGap`, :class:`PromptRate`)."""

    def export(self, backend: str) -> dict[str, Any]: ...

    def adopt(self, backend: str, state: Mapping[str, Any]) -> None: ...


_WARN_EVERY = 60.0


class SharedNormals:
    """This process's learned normals, kept in step with a store's (one entry per backend).

    - **Read at an attempt's start** (:meth:`before`): the first attempt at a backend in
      this process waits for the store's copy (one read; every concurrent first attempt
      waits for the same one), so a restarted gateway or a new replica judges it as the
      warm one would. After that, a copy older than ``refresh`` seconds is read again in
      the background, at the start of the next attempt: no attempt waits for it.
    - **Written after an attempt taught something** (:meth:`taught`), in the background,
      at most once every ``flush`` seconds for all the backends taught meanwhile (what an
      attempt taught within ``flush`` of the last write goes with the next one), and on
      :meth:`aclose`. Entries live ``ttl`` seconds from their last write.
    - A streamed chunk costs nothing here: one sample per attempt, as before.

    Replicas share one entry per backend, last writer wins: each adopts the others'
    copy at its next read (unless it has unwritten samples of its own), so they judge
    by one normal within ``refresh`` seconds; a sample taught between two reads on two
    replicas at once may be lost, which a normal (a quantile, a running mean) absorbs.
    A store that fails is logged (once a minute) and the normals stay this process's.
    """

    def __init__(
        self,
        store: _Normals,
        parts: Mapping[str, _Part],
        *,
        refresh: float = 5.0,
        flush: float = 1.0,
        ttl: float = 86400.0,
    ) -> None:
        self.store = store
        self.parts = dict(parts)
        self.refresh = duration("refresh", refresh)
        self.flush = duration("flush", flush)
        self.ttl = duration("ttl", ttl)
        self._read_at: dict[str, float] = {}
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._dirty: set[str] = set()
        self._seen: dict[str, str] = {}  # per backend: the value last written or adopted
        self._written_at = -math.inf
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned = -math.inf
        self._writer = os.urandom(6).hex()  # (two replicas never write the same value)
        self._seq = 0

    def before(self, backend: str) -> Awaitable[None] | None:
        """At an attempt's start: None, or the first read of ``backend``'s normals to wait
        for (a copy older than ``refresh`` is read again in the background)."""
        read_at = self._read_at.get(backend)
        if read_at is not None and clock.now() - read_at < self.refresh:
            return None
        read_now = getattr(self.store, "normals_get_now", None)
        if read_now is not None:  # this process's own store: read at once, nothing to wait for
            self._read_at[backend] = clock.now()
            try:
                value = read_now(backend)
            except Exception as exc:  # a store must never fail a request
                self._failed("read", exc)
                return None
            self._adopt(backend, value)
            return None
        loading = self._loading.get(backend)
        if loading is None:
            loading = self._loading[backend] = self._spawn(self._read(backend))
        return asyncio.shield(loading) if read_at is None else None

    def taught(self, backend: str) -> None:
        """An attempt at ``backend`` taught a learned value: written now in the background
        if nothing was written for ``flush`` seconds, else with the next such write (at
        the end of a later attempt, or on :meth:`aclose`). No timer: an idle gateway
        wakes for nothing."""
        self._dirty.add(backend)
        now = clock.now()
        if now - self._written_at >= self.flush:
            self._written_at = now
            self._spawn(self._write())

    async def aclose(self) -> None:
        """Write what was taught and not yet written; wait for every read and write."""
        await self._write()
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _failed(self, what: str, exc: BaseException) -> None:
        now = clock.now()
        if now - self._warned >= _WARN_EVERY:
            self._warned = now
            log_event("watchdog.normals_store_failed", level=30, doing=what, error=repr(exc))

    async def _read(self, backend: str) -> None:
        try:
            value = await self.store.normals_get(backend)
        except Exception as exc:  # a store must never fail a request
            self._failed("read", exc)
            value = None
        finally:
            self._loading.pop(backend, None)
            self._read_at[backend] = clock.now()
        self._adopt(backend, value)

    def _adopt(self, backend: str, value: str | None) -> None:
        if value is None or value == self._seen.get(backend) or backend in self._dirty:
            return  # nothing there, our own copy, or ours is newer (written within flush)
        try:
            state = json.loads(value)
            for name, part in self.parts.items():
                got = state.get(name)
                if isinstance(got, dict):
                    part.adopt(backend, got)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            self._failed("adopt", exc)
            return
        self._seen[backend] = value

    async def _write(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for backend in sorted(dirty):
            self._seq += 1
            state: dict[str, Any] = {"by": self._writer, "seq": self._seq}
            for name, part in self.parts.items():
                state[name] = part.export(backend)
            value = json.dumps(state, separators=(",", ":"))
            self._seen[backend] = value
            try:
                await self.store.normals_put(backend, value, self.ttl)
            except Exception as exc:
                self._failed("write", exc)
