"""KeyLimits: per caller key, requests and tokens per minute and a token budget; usage.

It stands right behind :class:`~tierchain.keys.CallerKeys` (which leaves the
matched key in the scope under :data:`~tierchain.keys.CALLER_KEY`), in front of
everything routed, and ``tierchain serve`` puts it there only when a key in the
keys file has a limit or the file has a ``[[backend_budgets]]`` table: without
either, nothing of this module runs.

Per request:

1. **Before anything else runs**: one store call checks the key's limits over
   their sliding windows (:class:`~tierchain.store.WindowCheck`, summed in 60
   buckets): ``rpm`` counts this request, ``tpm`` and ``budget_tokens`` must not
   be spent already. Over any: ``429`` with ``Retry-After`` (the seconds until the
   window has room) and an OpenAI-style error (``rate_limit_error``, code
   ``rpm_exceeded``, ``tpm_exceeded`` or ``budget_exceeded``); no route, no
   backend, no attempt.
2. **On the way out**, each chunk passes through a ``send`` wrapper that only
   keeps references: the first two body chunks and the last four that are not
   heartbeat comments (a whole answer that is not a stream: every chunk, up to
   16 MiB). Nothing is parsed while the answer flows.
3. **At the end**, the usage is read once from those few events
   (:mod:`tierchain.usage`, per wire format), or estimated where the backend sent
   none, and one store call adds it to the key's minute and budget windows, to
   the answering backend's budget window and to the running totals per key,
   route, backend and kind (:data:`KINDS`). ``tierchain_tokens_total`` counts
   the same.

A request whose answering attempt failed after it began answering (a stream cut
short) is counted with the ``failed_`` kinds; attempts that failed before (a
``500``, a refused connection, a ``404``) carry no tokens and are counted as
failed attempts per backend in the totals. Failed tokens count against the
limits and budgets as well: the backend may bill them.

:class:`BackendBudgets` stands inside Failover, in front of the handler: an
attempt at a backend whose ``[[backend_budgets]]`` tokens are spent is skipped
before sending (``backend_busy``, reason ``budget``), so the chain moves on.

The store (:class:`~tierchain.MemoryStore` or :class:`~tierchain.RedisStore`)
holds the windows and the totals, so replicas that share a RedisStore share the
counts. A key appears everywhere by its ``name``, never the key itself.
"""

from __future__ import annotations

import logging
import math
import tomllib
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ._checks import count, duration, parse_duration
from ._head import refuse_request
from ._types import ASGIApp, Message, Receive, Scope, Send
from .errors import BackendBusy
from .keys import CALLER_KEY, CallerKey
from .request import SCOPE_KEY, TierRequest
from .sse import data_values
from .store import MemoryStore, WindowCheck
from .telemetry import TOKENS, labelled, log_event
from .usage import body_units, estimate, read_usage
from .wire import OLLAMA

__all__ = [
    "KINDS",
    "BackendBudget",
    "BackendBudgets",
    "KeyLimits",
    "load_budgets",
    "usage_report",
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

MINUTE = 60.0
_HOLD_WHOLE = 16 * 2**20  # a whole answer's bytes kept (by reference) to read its usage
_HEAD = 2  # body chunks kept from the start (Anthropic's message_start)
_TAIL = 4  # body chunks kept from the end (the usage events)
_SEP = "\t"
_NOT_BILLED = frozenset({"skipped", "busy"})  # never reached the backend


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


def _window(kind: str, name: str) -> str:
    return f"{kind}{_SEP}{name}"


def _checks(key: CallerKey) -> list[tuple[WindowCheck, str]]:
    checks = []
    if key.rpm is not None:
        checks.append((WindowCheck(_window("rpm", key.name), MINUTE, key.rpm, 1), "rpm"))
    if key.tpm is not None:
        checks.append((WindowCheck(_window("tpm", key.name), MINUTE, key.tpm), "tpm"))
    if key.budget_tokens is not None:
        window = _window("budget", key.name)
        checks.append((WindowCheck(window, key.budget_period, key.budget_tokens), "budget"))
    return checks


_REFUSALS = {
    "rpm": ("rpm_exceeded", "{n} requests per minute"),
    "tpm": ("tpm_exceeded", "{n} tokens per minute"),
    "budget": ("budget_exceeded", "its budget of {n} tokens per {period}"),
}


class KeyLimits:
    """Enforce each caller key's ``rpm``, ``tpm`` and budget; count its tokens.

    Stand it right behind :class:`~tierchain.keys.CallerKeys`. ``store``: where the
    windows and totals live (share a :class:`~tierchain.RedisStore` between
    replicas; None: a MemoryStore of its own). ``budgets``: the backend budgets,
    whose windows this layer fills (the :class:`BackendBudgets` inside Failover
    reads them).
    """

    limits_per_key = True
    """Read by :class:`~tierchain.keys.CallerKeys`, which refuses ``open_paths`` in front
    of a layer that limits per key."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: Any = None,
        budgets: Iterable[BackendBudget] = (),
    ) -> None:
        self.app = app
        self.store = store if store is not None else MemoryStore()
        self.budgets = {b.backend: b for b in budgets}
        self._checks: dict[str, list[tuple[WindowCheck, str]]] = {}

    def __repr__(self) -> str:
        return f"KeyLimits(budgets={sorted(self.budgets)})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if CALLER_KEY not in scope:
            raise RuntimeError(
                "KeyLimits needs CallerKeys in front of it: it limits and counts per caller key"
            )
        key: CallerKey | None = scope[CALLER_KEY]
        if key is None:  # the anonymous caller of an open path: no key to limit or count
            # (build_stack and CallerKeys refuse open paths in front of limits to hold)
            return await self.app(scope, receive, send)
        checks = self._checks.get(key.name)
        if checks is None:
            checks = self._checks[key.name] = _checks(key)
        if checks:
            refused = await self.store.window_admit([c for c, _ in checks])
            if refused is not None:
                return await self._refuse(scope, send, key, checks[refused[1]][1], refused[0])
        meter = _Meter(send)
        try:
            await self.app(scope, receive, meter.send)
        finally:
            try:
                await self._account(scope, key, meter)
            except Exception as exc:  # accounting must never break an answered request
                log_event("usage.not_recorded", logging.WARNING, key_name=key.name, error=repr(exc))

    async def _refuse(
        self, scope: Scope, send: Send, key: CallerKey, which: str, wait: float
    ) -> None:
        retry = max(1, math.ceil(wait))
        code, what = _REFUSALS[which]
        n = {"rpm": key.rpm, "tpm": key.tpm, "budget": key.budget_tokens}[which]
        said = what.format(n=n, period=_period(key.budget_period))
        await self.store.usage_record((), [(_field(key.name, "-", "-", "refused"), 1)])
        log_event("usage.limited", key_name=key.name, limit=which, retry_after_s=retry)
        await refuse_request(
            scope,
            send,
            429,
            f"key {key.name!r} is over {said}; retry in {retry}s",
            code,
            type="rate_limit_error",
            headers=[(b"retry-after", str(retry).encode())],
        )

    async def _account(self, scope: Scope, key: CallerKey, meter: _Meter) -> None:
        req: TierRequest | None = scope.get(SCOPE_KEY)
        route = (req.route if req is not None else None) or "-"
        totals: list[tuple[str, int]] = [(_field(key.name, route, "-", "requests"), 1)]
        if req is not None:
            for record in req.attempts:
                if record.outcome != "ok" and record.outcome not in _NOT_BILLED:
                    totals.append((_field(key.name, route, record.backend, "failed_attempts"), 1))
        backend, tokens = self._tokens(req, meter)
        windows: list[tuple[str, float, int]] = []
        spent = 0
        for kind, amount in tokens:
            if amount:
                totals.append((_field(key.name, route, backend, kind), amount))
                labelled(TOKENS, key.name, route, backend, kind).inc(amount)
                spent += amount
        if spent:
            if key.tpm is not None:
                windows.append((_window("tpm", key.name), MINUTE, spent))
            if key.budget_tokens is not None:
                windows.append((_window("budget", key.name), key.budget_period, spent))
            budget = self.budgets.get(backend)
            if budget is not None:
                windows.append((_window("backend", backend), budget.period, spent))
        await self.store.usage_record(windows, totals)

    def _tokens(self, req: TierRequest | None, meter: _Meter) -> tuple[str, list[tuple[str, int]]]:
        """The answering backend's name and its tokens by kind (none when nothing answered)."""
        if meter.status is None or not 200 <= meter.status < 300:
            return "-", []
        if req is not None and req.attempts and not req.committed:
            return "-", []  # no attempt began answering (Heartbeats' own 200 is not one)
        attempt = req.attempt if req is not None else None
        backend = attempt.backend.name if attempt is not None else "-"
        wire = (attempt.backend.wire_format if attempt is not None else None) or (
            req.wire if req is not None else None
        )
        found = read_usage(wire, meter.values(wire))
        observer = req.observer if req is not None else None
        if meter.whole is not None:
            units = body_units(meter.size)
        else:
            units = observer.data_events if observer is not None else meter.chunks
            units = max(0, units - (0 if wire == OLLAMA else 1))  # the terminator
        usage = estimate(found, len(req.body or b"") if req is not None else 0, units)
        ok = req is None or not req.attempts or req.attempts[-1].outcome == "ok"
        prefix = "" if ok else "failed_"
        return backend, [
            (
                f"{prefix}input{'_estimated' if usage.input_estimated and ok else ''}",
                usage.input,
            ),
            (
                f"{prefix}output{'_estimated' if usage.output_estimated and ok else ''}",
                usage.output,
            ),
        ]


class _Meter:
    """The send wrapper: keeps references to the chunks that can carry the usage."""

    __slots__ = ("_send", "chunks", "head", "size", "status", "stream", "tail", "whole")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status: int | None = None
        self.stream = False
        self.head: list[bytes] = []
        self.tail: list[bytes] = []
        self.whole: list[bytes] | None = None
        self.size = 0
        self.chunks = 0

    def send(self, message: Message) -> Awaitable[None]:
        kind = message["type"]
        if kind == "http.response.body":
            chunk: bytes = message.get("body", b"")
            if chunk:
                self.chunks += 1
                whole = self.whole
                if whole is not None:
                    self.size += len(chunk)
                    if self.size <= _HOLD_WHOLE:
                        whole.append(chunk)
                elif chunk[:1] == b":" and b"data:" not in chunk:
                    pass  # heartbeat comments only: no usage in them
                elif len(self.head) < _HEAD:
                    self.head.append(chunk)
                else:
                    tail = self.tail
                    tail.append(chunk)
                    if len(tail) > _TAIL:
                        del tail[0]
        elif kind == "http.response.start":
            self.status = int(message["status"])
            for name, value in message.get("headers", ()):
                if name.lower() == b"content-type":
                    value = value.lower()
                    self.stream = b"event-stream" in value or b"ndjson" in value
            if not self.stream:
                self.whole = []
        return self._send(message)

    def values(self, wire: str | None) -> list[bytes]:
        """The JSON values that may carry the usage, in order."""
        if self.whole is not None:
            return [b"".join(self.whole)] if self.size <= _HOLD_WHOLE else []
        if wire == OLLAMA:
            return b"".join(self.tail or self.head).splitlines()[-2:]
        events = b"".join(self.head)
        values = data_values(events) if events else []
        if self.tail:
            values += data_values(b"".join(self.tail))
        return values


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
                    _window("backend", budget.backend), budget.period, budget.tokens
                )
                refused = await self.store.window_admit([check])
                if refused is not None:
                    raise BackendBusy(
                        f"backend {budget.backend!r} spent its budget of {budget.tokens} tokens "
                        f"per {_period(budget.period)}",
                        why="budget",
                    )
        await self.app(scope, receive, send)


def _field(key_name: str, route: str, backend: str, kind: str) -> str:
    return _SEP.join((key_name, route, backend, kind))


def _period(seconds: float) -> str:
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


async def usage_report(store: Any, keys: Sequence[CallerKey] = ()) -> dict[str, Any]:
    """The usage read-out (the Admin's ``GET /usage`` and its page): per key name, route,
    backend and kind, the running totals; per key given, its limits and what its windows
    hold now."""
    totals = await store.usage_totals() if hasattr(store, "usage_totals") else {}
    rows = []
    for field_name, amount in sorted(totals.items()):
        parts = field_name.split(_SEP)
        if len(parts) == 4:
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
    by_key: dict[str, dict[str, int]] = {}
    for row in rows:
        sums = by_key.setdefault(row["key_name"], {})
        sums[row["kind"]] = sums.get(row["kind"], 0) + row["value"]
    limits = []
    for key in keys:
        windows = [(c.name, c.window) for c, _ in _checks(key)]
        used = await store.window_sums(windows) if windows else []
        now = {what: n for (_, what), n in zip(_checks(key), used, strict=True)}
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
            }
        )
    return {
        "keys": [{"key_name": name, **sums} for name, sums in sorted(by_key.items())],
        "limits": limits,
        "usage": rows,
    }
