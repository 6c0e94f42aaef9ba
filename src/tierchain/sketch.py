"""A streaming quantile sketch: fixed log-spaced buckets, recent samples weigh more.

:class:`LogSketch` keeps one count per bucket; bucket ``i`` holds values in
``[lo * growth**i, lo * growth**(i+1))``, so any quantile is known to within
one bucket (``growth`` - 1, 8% by default) whatever the distribution. Memory
is fixed (about 200 floats for 1 ms .. 1 h) and an update is O(1).

Older samples fade: each new sample weighs ``2 ** (1 / half_life)`` times the
previous one, so after ``half_life`` samples an old one counts half. A backend
that changed (a model swap, a new GPU) is learned again without a reset.
"""

from __future__ import annotations

import math

__all__ = ["LogSketch"]


class LogSketch:
    """Quantiles of a stream of positive values, with exponential forgetting."""

    __slots__ = ("_counts", "_growth_log", "_lo", "_step", "_weight", "count", "growth")

    def __init__(
        self,
        *,
        lo: float = 1e-3,
        hi: float = 3600.0,
        growth: float = 1.08,
        half_life: float = 200.0,
    ) -> None:
        if not (0 < lo < hi and growth > 1 and half_life > 0):
            raise ValueError("LogSketch needs 0 < lo < hi, growth > 1 and half_life > 0")
        self._lo = lo
        self.growth = growth
        self._growth_log = math.log(growth)
        size = math.ceil(math.log(hi / lo) / self._growth_log) + 1
        self._counts = [0.0] * size
        self._step = 2.0 ** (1.0 / half_life)
        self._weight = 1.0
        self.count = 0
        """Samples added since the last reset (not faded)."""

    def add(self, value: float) -> None:
        """Add one sample (seconds, or any positive value)."""
        if not math.isfinite(value) or value < 0:
            return
        # the bucket index (a sample per successful attempt: no method call)
        lo = self._lo
        counts = self._counts
        i = 0 if value <= lo else int(math.log(value / lo) / self._growth_log)
        counts[i if i < len(counts) else len(counts) - 1] += self._weight
        self.count += 1
        self._weight *= self._step
        if self._weight > 1e100:  # rescale before the weights overflow
            self._counts = [c / self._weight for c in self._counts]
            self._weight = 1.0

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1), as the upper edge of its bucket; None when empty."""
        total = sum(self._counts)
        if total <= 0:
            return None
        target = min(max(q, 0.0), 1.0) * total
        running = 0.0
        for i, c in enumerate(self._counts):
            running += c
            if running >= target and c > 0:
                return self._lo * self.growth ** (i + 1)
        return self._lo * self.growth ** len(self._counts)

    def state(self) -> dict[str, object]:
        """The sketch as plain JSON values (what :meth:`load` takes back): its
        non-empty buckets, their weights scaled so the newest sample weighs 1."""
        weight = self._weight
        return {
            "n": self.count,
            "c": {str(i): c / weight for i, c in enumerate(self._counts) if c > 0},
        }

    def load(self, state: dict[str, object]) -> None:
        """Replace every sample with those of ``state`` (from :meth:`state`, maybe
        another process's). A malformed state raises ValueError and changes nothing."""
        counts = [0.0] * len(self._counts)
        raw = state.get("c")
        n = state.get("n")
        if not isinstance(raw, dict) or not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError("not a LogSketch state")
        for key, value in raw.items():
            i = int(key)
            if not (0 <= i < len(counts)) or not isinstance(value, int | float):
                raise ValueError("not a LogSketch state")
            if math.isfinite(value) and value > 0:
                counts[i] = float(value)
        self._counts = counts
        self._weight = 1.0
        self.count = n

    def reset(self) -> None:
        """Forget every sample."""
        self._counts = [0.0] * len(self._counts)
        self._weight = 1.0
        self.count = 0
