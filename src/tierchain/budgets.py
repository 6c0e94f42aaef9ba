"""BackendBudgets: a backend's own token budget, every caller key together.

It stands inside Failover, in front of the handler: an attempt at a backend whose
``[[backend_budgets]]`` tokens are spent is skipped before sending (``backend_busy``,
reason ``budget``), so the chain moves on. :class:`~tierchain.limits.KeyLimits` fills
the budgets' windows as it counts each answer (see docs/limits.md).
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ._checks import count, duration, parse_duration
from ._types import ASGIApp, Receive, Scope, Send
from .accounts import period_text, window_name
from .errors import BackendBusy
from .request import SCOPE_KEY, TierRequest
from .store import MemoryStore, WindowCheck

__all__ = ["BackendBudget", "BackendBudgets", "load_budgets"]


@dataclass(frozen=True, slots=True)
class BackendBudget:
    """At most ``tokens`` tokens per ``period`` seconds (sliding) at ``backend``, all keys."""

    backend: str
    tokens: int
    period: float = 86400.0

    def __post_init__(self) -> None:
        count(f"backend budget {self.backend!r}: tokens", self.tokens)
        period = duration(f"backend budget {self.backend!r}: period", self.period, at_least=60.0)
        object.__setattr__(self, "period", period)


def load_budgets(path: str) -> tuple[BackendBudget, ...]:
    """The keys file's ``[[backend_budgets]]`` tables: ``backend``, ``tokens``, ``period``."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    tables = data.get("backend_budgets", [])
    if not isinstance(tables, list):
        raise ValueError(f"{path}: backend_budgets must be [[backend_budgets]] tables")
    budgets = []
    for n, table in enumerate(tables, 1):
        if not isinstance(table, dict) or not isinstance(table.get("backend"), str):
            raise ValueError(f'{path}: [[backend_budgets]] entry {n} needs backend = "<name>"')
        unknown = set(table) - {"backend", "tokens", "period"}
        if unknown:
            raise ValueError(
                f"{path}: [[backend_budgets]] entry {n} has unknown fields {sorted(unknown)}"
            )
        period = table.get("period", 86400.0)
        try:
            if isinstance(period, str):
                period = parse_duration(period)
            budgets.append(BackendBudget(table["backend"], table.get("tokens", 0), period))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    return tuple(budgets)


class BackendBudgets:
    """Inside Failover, in front of the handler: skip an attempt at a backend whose budget
    is spent (``BackendBusy``, reason ``budget``), before anything is sent to it."""

    def __init__(
        self, app: ASGIApp, *, store: Any = None, budgets: Iterable[BackendBudget] = ()
    ) -> None:
        self.app = app
        self.store = store if store is not None else MemoryStore()
        self.budgets = {b.backend: b for b in budgets}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.budgets and SCOPE_KEY in scope:
            attempt = TierRequest.of(scope).attempt
            budget = self.budgets.get(attempt.backend.name) if attempt is not None else None
            if budget is not None:
                check = WindowCheck(
                    window_name("backend", budget.backend), budget.period, budget.tokens
                )
                refused = await self.store.window_admit([check])
                if refused is not None:
                    raise BackendBusy(
                        f"backend {budget.backend!r} spent its budget of {budget.tokens} tokens "
                        f"per {period_text(budget.period)}",
                        why="budget",
                    )
        await self.app(scope, receive, send)
