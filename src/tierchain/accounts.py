"""The names a key's usage lives under in a store, and the usage read-out.

:class:`~tierchain.limits.KeyLimits` writes, :func:`usage_report` reads, and
:class:`~tierchain.budgets.BackendBudgets` checks the same windows and totals:

- a windowed counter per key and limit, ``rpm<TAB>name``, ``tpm<TAB>name``,
  ``budget<TAB>name`` (:func:`key_checks`), and per backend with a budget,
  ``backend<TAB>name``;
- a running total per key name, route, backend and kind (:func:`total_field`):
  the token kinds (:data:`KINDS`), ``requests``, ``refused``, ``failed_attempts``,
  and for a priced backend each token kind's cost in nano-units of the price's
  currency (the kind with :data:`COST_SUFFIX`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .keys import CallerKey
from .request import TierRequest
from .store import WindowCheck, WindowHold
from .usage import bounded

__all__ = [
    "ANONYMOUS",
    "COST_SUFFIX",
    "KINDS",
    "MINUTE",
    "cost_nanos",
    "key_checks",
    "period_text",
    "price_of",
    "rate_headers",
    "total_field",
    "usage_report",
    "window_name",
]

KINDS = (
    "input",
    "output",
    "input_estimated",
    "output_estimated",
    "failed_input",
    "failed_output",
)
"""The token kinds: as the answering backend reported them, estimated where it did not,
and those of an attempt that failed after it began answering."""

ANONYMOUS = "(anonymous)"
"""The name a request let through on an open path without a key is counted under."""

MINUTE = 60.0
COST_SUFFIX = ":cost"
"""A total's kind with this suffix holds the cost of that kind's tokens, in nano-units."""
_SEP = "\t"


def window_name(kind: str, name: str) -> str:
    """The windowed counter of limit ``kind`` (rpm, tpm, budget, backend) for ``name``."""
    return f"{kind}{_SEP}{name}"


def key_checks(key: CallerKey, reserve: int = 0) -> list[tuple[WindowCheck, str]]:
    """The key's windows to check on admission; ``reserve``: the tokens this request holds
    in its token windows (they must only have room left: the last one in may overrun)."""
    checks = []
    if key.rpm is not None:
        checks.append((WindowCheck(window_name("rpm", key.name), MINUTE, key.rpm, 1), "rpm"))
    if key.tpm is not None:
        check = WindowCheck(window_name("tpm", key.name), MINUTE, key.tpm, reserve, fits=False)
        checks.append((check, "tpm"))
    if key.budget_tokens is not None:
        window = window_name("budget", key.name)
        check = WindowCheck(window, key.budget_period, key.budget_tokens, reserve, fits=False)
        checks.append((check, "budget"))
    return checks


def total_field(key_name: str, route: str, backend: str, kind: str) -> str:
    """The running total of ``kind`` for (key name, route, backend)."""
    return _SEP.join((key_name, route, backend, kind))


def price_of(req: TierRequest | None) -> tuple[float, float] | None:
    """The answering backend's price (input, output per million tokens), or None."""
    attempt = req.attempt if req is not None else None
    if attempt is None:
        return None
    backend = attempt.backend
    if backend.price_input is None and backend.price_output is None:
        return None
    return backend.price_input or 0.0, backend.price_output or 0.0


def cost_nanos(amount: int, price: tuple[float, float] | None, kind: str) -> int:
    """The cost of ``amount`` tokens of ``kind`` in nano-units of the price's currency."""
    if price is None:
        return 0
    per_million = price[1] if kind.endswith(("output", "output_estimated")) else price[0]
    return bounded(round(amount * per_million * 1000), "cost", "price")


def _reset_text(seconds: float) -> str:
    """A reset time as OpenAI writes it: ``12ms``, ``1s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


_RATE_HEADERS = {"rpm": b"requests", "tpm": b"tokens"}


def rate_headers(
    checks: list[tuple[WindowCheck, str]], hold: WindowHold | None
) -> list[tuple[bytes, bytes]]:
    """The ``x-ratelimit-*`` headers for a key's rpm and tpm (LiteLLM's and OpenAI's names),
    from what its windows hold at admission (``hold``)."""
    if hold is None or len(hold.used) != len(checks):
        return []
    out = []
    for (check, which), used, reset in zip(checks, hold.used, hold.reset, strict=True):
        unit = _RATE_HEADERS.get(which)
        if unit is not None:
            out.append((b"x-ratelimit-limit-" + unit, str(check.limit).encode()))
            left = max(0, check.limit - used)
            out.append((b"x-ratelimit-remaining-" + unit, str(left).encode()))
            out.append((b"x-ratelimit-reset-" + unit, _reset_text(reset).encode()))
    return out


def period_text(seconds: float) -> str:
    """A period as a duration a person reads: ``1d``, ``12h``, ``30m``, ``90s``."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


async def usage_report(store: Any, keys: Sequence[CallerKey] = ()) -> dict[str, Any]:
    """The usage read-out (the Admin's ``GET /usage`` and its page): per key name, route,
    backend and kind, the running totals and their ``cost`` (None where the backend has no
    price); per key, the sums and the ``cost``; per key given, its limits and what its
    windows hold now."""
    totals = await store.usage_totals() if hasattr(store, "usage_totals") else {}
    rows: list[dict[str, Any]] = []
    costs: dict[tuple[str, ...], int] = {}
    for field_name, amount in sorted(totals.items()):
        parts = field_name.split(_SEP)
        if len(parts) != 4:
            continue
        if parts[3].endswith(COST_SUFFIX):
            costs[(*parts[:3], parts[3].removesuffix(COST_SUFFIX))] = amount
            continue
        key_name, route, backend, kind = parts
        rows.append(
            {
                "key_name": key_name,
                "route": route,
                "backend": backend,
                "kind": kind,
                "value": amount,
            }
        )
    by_key: dict[str, dict[str, Any]] = {}
    for row in rows:
        nanos = costs.get((row["key_name"], row["route"], row["backend"], row["kind"]))
        row["cost"] = None if nanos is None else nanos / 1e9
        sums = by_key.setdefault(row["key_name"], {})
        sums[row["kind"]] = sums.get(row["kind"], 0) + row["value"]
        if nanos is not None:
            sums["cost"] = round(sums.get("cost", 0.0) + nanos / 1e9, 9)
    limits = []
    for key in keys:
        checks = key_checks(key)
        windows = [(c.name, c.window) for c, _ in checks]
        used = await store.window_sums(windows) if windows else []
        now = {what: n for (_, what), n in zip(checks, used, strict=True)}
        limits.append(
            {
                "key_name": key.name,
                "rpm": key.rpm,
                "rpm_used": now.get("rpm"),
                "tpm": key.tpm,
                "tpm_used": now.get("tpm"),
                "budget_tokens": key.budget_tokens,
                "budget_period_s": key.budget_period if key.budget_tokens is not None else None,
                "budget_used": now.get("budget"),
                "max_parallel": key.max_parallel,
            }
        )
    return {
        "keys": [{"key_name": name, **sums} for name, sums in sorted(by_key.items())],
        "limits": limits,
        "usage": rows,
    }
