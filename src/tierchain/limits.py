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

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Iterable
from datetime import timedelta
from typing import Any

from . import formats
from ._body import DEFAULT_BODY_TIMEOUT, read_or_refuse, replayed, timeout_option
from ._checks import count
from ._head import refuse_request
from ._runtime import clock
from ._runtime.interrupt import Interruption
from ._types import ASGIApp, Message, Receive, Scope, Send
from .accounts import (
    ANONYMOUS,
    COST_SUFFIX,
    KINDS,
    MINUTE,
    cost_nanos,
    key_checks,
    period_text,
    price_of,
    rate_headers,
    total_field,
    usage_report,
    window_name,
)
from .admission import Admission, Lease
from .budgets import BackendBudget, BackendBudgets, load_budgets
from .keys import CALLER_KEY, CallerKey
from .request import TierRequest
from .sse import data_values, first_events
from .store import USAGE_BOUND, MemoryStore, WindowCheck, WindowHold
from .telemetry import COST, TOKENS, labelled, log_event, observe_usage
from .usage import DEFAULT_MAX_TOKENS, body_units, bounded, estimate, read_usage, reservation
from .wire import error_format

__all__ = [
    "ANONYMOUS",
    "KINDS",
    "BackendBudget",
    "BackendBudgets",
    "KeyLimits",
    "load_budgets",
    "usage_report",
]

_HOLD_WHOLE = 16 * 2**20  # a whole answer's bytes kept (by reference) to read its usage
_HEAD = 2  # body chunks kept from the start (Anthropic's message_start)
_TAIL = 4  # body chunks kept from the end (the usage events)
_NOT_BILLED = frozenset({"skipped", "busy"})  # never reached the backend


_REFUSALS = {
    "rpm": ("rpm_exceeded", "{n} requests per minute"),
    "tpm": ("tpm_exceeded", "{n} tokens per minute"),
    "budget": ("budget_exceeded", "its budget of {n} tokens per {period}"),
    "parallel": ("parallel_exceeded", "{n} requests in flight (max_parallel)"),
}


class _Held:
    """One request's reservation in its key's token windows, grown while its stream runs
    past it, released when it ends (:meth:`KeyLimits._account`)."""

    __slots__ = (
        "crossed",
        "cut",
        "held",
        "holds",
        "last",
        "scope",
        "spent",
        "step",
        "store",
        "windows",
    )

    def __init__(
        self,
        scope: Scope,
        store: Any,
        checks: list[tuple[WindowCheck, str]],
        prompt: int,
        total: int,
    ) -> None:
        self.scope = scope
        self.store = store
        self.windows = [(c, which) for c, which in checks if which != "rpm"]
        self.holds: list[tuple[float, int]] = []  # (store time, tokens) per hold
        self.held = 0
        self.spent = prompt  # the prompt estimate, then a token per data event
        self.step = max(_STEP, total - prompt)
        self.crossed: str | None = None
        self.last: str | None = None  # the window a step took to its limit: no more steps
        self.cut = Interruption()

    @property
    def wire(self) -> str:
        """The request's wire format, for the error that ends a stream."""
        req = TierRequest.find(self.scope)
        attempt = req.attempt if req is not None else None
        wire = attempt.backend.wire_format if attempt is not None else None
        return (
            wire
            or (req.wire if req is not None else None)
            or error_format(self.scope.get("path") or "")
        )

    def took(self, at: float, amount: int) -> None:
        self.holds.append((at, amount))
        self.held += amount

    async def extend(self) -> bool:
        """Hold another step, if the key's token windows still have room (False: crossed)."""
        if self.last is not None:
            self.crossed = self.last
            return False
        checks = [
            WindowCheck(c.name, c.window, c.limit, self.step, fits=False) for c, _ in self.windows
        ]
        try:
            hold = await self.store.window_hold(checks)
        except Exception as exc:  # a store error never cuts an answer
            log_event("usage.not_held", logging.WARNING, error=repr(exc))
            self.held += self.step
            return True
        if hold.refused is not None:
            self.crossed = self.windows[hold.refused[1]][1]
            return False
        self.took(hold.at, self.step)
        # A step goes in while a window has room, and may take it past its limit: this
        # stream may then use only the room there was, and ends past it without asking.
        over, which = max(
            (used - c.limit, w) for used, (c, w) in zip(hold.used, self.windows, strict=True)
        )
        if over > 0:
            self.held -= min(over, self.step)
            self.last = which
        return True

    def released(self) -> list[tuple[str, float, int, float]]:
        holds = self.holds
        return [(c.name, c.window, amount, at) for c, _ in self.windows for at, amount in holds]


_STEP = 256  # the least a stream past its reservation holds more by


class KeyLimits:
    """Enforce each caller key's ``rpm``, ``tpm``, budget and ``max_parallel``; count
    every key's tokens (and their cost, where the backend has a price).

    Stand it right behind :class:`~tierchain.keys.CallerKeys`. ``store``: where the
    windows and totals live (share a :class:`~tierchain.RedisStore` between
    replicas; None: a MemoryStore of its own). ``budgets``: the backend budgets,
    whose windows this layer fills (the :class:`BackendBudgets` inside Failover
    reads them). ``default_max_tokens``: the output a request that names no
    ``max_tokens`` reserves (a key's own ``default_max_tokens`` wins).
    ``max_body``, ``body_timeout``: the most body bytes read to reserve a request's
    tokens, and the time the body may take (413 and 408 beyond, as Failover's own).
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
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        max_body: int = 32 * 2**20,
        body_timeout: float | timedelta | None = DEFAULT_BODY_TIMEOUT,
    ) -> None:
        self.app = app
        self.store = store if store is not None else MemoryStore()
        self.budgets = {b.backend: b for b in budgets}
        self.default_max_tokens = count("default_max_tokens", default_max_tokens, minimum=0)
        self.max_body = count("max_body", max_body, minimum=0)
        self.body_timeout = timeout_option("body_timeout", body_timeout)
        self._parallel = Admission(self.store)

    def __repr__(self) -> str:
        return (
            f"KeyLimits(budgets={sorted(self.budgets)}, "
            f"default_max_tokens={self.default_max_tokens})"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if CALLER_KEY not in scope:
            raise RuntimeError(
                "KeyLimits needs CallerKeys in front of it: it limits and counts per caller key"
            )
        key: CallerKey | None = scope[CALLER_KEY]
        if key is not None and key.limited:
            return await self._limited(scope, receive, send, key)
        meter = _Meter(send)
        try:
            await self.app(scope, receive, meter.send)
        finally:
            await self._settle(scope, key, meter, None)

    async def _limited(self, scope: Scope, receive: Receive, send: Send, key: CallerKey) -> None:
        prompt = reserve = 0
        if key.tpm is not None or key.budget_tokens is not None:
            body = await read_or_refuse(scope, receive, send, self.max_body, self.body_timeout)
            if body is None:
                return  # answered 413 or 408, or the caller left
            receive = replayed(body, receive)
            default = key.default_max_tokens
            prompt, reserve = await reservation(
                body, self.default_max_tokens if default is None else default
            )
        lease: Lease | None = None
        if key.max_parallel is not None:
            lease, live = await self._parallel.take("\t" + key.name, key.max_parallel)
            if lease is None and live:
                return await self._refuse(scope, send, key, "parallel", 1.0, [])
        checks = key_checks(key, reserve)
        held = _Held(scope, self.store, checks, prompt, reserve)
        hold: WindowHold | None = None
        try:
            if checks:  # (a key with max_parallel alone has no window)
                hold = await self.store.window_hold([c for c, _ in checks])
        except Exception as exc:  # a store error never refuses a request
            log_event("usage.not_checked", logging.WARNING, key_name=key.name, error=repr(exc))
            hold = None
        headers = rate_headers(checks, hold)
        if hold is not None and hold.refused is not None:
            await self._parallel.leave(lease)
            which = checks[hold.refused[1]][1]
            return await self._refuse(scope, send, key, which, hold.refused[0], headers)
        if hold is not None and reserve:
            held.took(hold.at, reserve)
        else:
            held.held = USAGE_BOUND  # nothing held: nothing to grow or cut
        meter = _Meter(send, headers, held if held.windows else None)
        cut = held.cut
        cut.arm()
        try:
            await self.app(scope, receive, meter.send)
        except asyncio.CancelledError:
            if not cut.ours():
                raise
        finally:
            try:
                await self._settle(scope, key, meter, held)
            finally:
                await self._parallel.leave(lease)

    async def _settle(
        self, scope: Scope, key: CallerKey | None, meter: _Meter, held: _Held | None
    ) -> None:
        try:
            await self._account(scope, key, meter, held)
        except Exception as exc:  # accounting must never break an answered request
            name = key.name if key is not None else ANONYMOUS
            log_event("usage.not_recorded", logging.WARNING, key_name=name, error=repr(exc))

    async def _refuse(
        self,
        scope: Scope,
        send: Send,
        key: CallerKey,
        which: str,
        wait: float,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        retry = max(1, math.ceil(wait))
        code, what = _REFUSALS[which]
        limit = {"rpm": key.rpm, "tpm": key.tpm, "budget": key.budget_tokens}.get(which)
        said = what.format(n=limit or key.max_parallel, period=period_text(key.budget_period))
        await self.store.usage_record((), [(total_field(key.name, "-", "-", "refused"), 1)])
        log_event("usage.limited", key_name=key.name, limit=which, retry_after_s=retry)
        extra: dict[str, Any] = {}
        headers = [*headers, (b"retry-after", str(retry).encode())]
        message = f"key {key.name!r} is over {said}; retry in {retry}s"
        if which == "budget":
            # Not a rate to wait out: the SDKs are told not to retry (they would spend their
            # retries at once); the body says when the budget has room again.
            renews = clock.wall() + wait
            extra = {"renews_in_s": retry, "renews_at": _iso(renews)}
            message = (
                f"key {key.name!r} spent {said}; it has room again in {retry}s "
                f"(at {extra['renews_at']})"
            )
            headers.append((b"x-should-retry", b"false"))
        await refuse_request(
            scope, send, 429, message, code, type="rate_limit_error", headers=headers, **extra
        )

    async def _account(
        self, scope: Scope, key: CallerKey | None, meter: _Meter, held: _Held | None
    ) -> None:
        name = key.name if key is not None else ANONYMOUS
        req = TierRequest.find(scope)
        route = (req.route if req is not None else None) or "-"
        totals: list[tuple[str, int]] = [(total_field(name, route, "-", "requests"), 1)]
        if req is not None:
            # A stream ended here (its key ran out) was answered: no failed attempt of its own.
            records = req.attempts[:-1] if meter.ended else req.attempts
            for record in records:
                if record.outcome != "ok" and record.outcome not in _NOT_BILLED:
                    totals.append((total_field(name, route, record.backend, "failed_attempts"), 1))
        backend, tokens = self._tokens(req, meter)
        price = price_of(req)
        windows: list[tuple[str, float, int]] = []
        spent = 0
        cost = 0
        for kind, amount in tokens:
            if amount:
                totals.append((total_field(name, route, backend, kind), amount))
                labelled(TOKENS, name, route, backend, kind).inc(amount)
                spent += amount
                nanos = cost_nanos(amount, price, kind)
                if price is not None:  # (a free backend's 0 too: free is not unpriced)
                    totals.append((total_field(name, route, backend, kind + COST_SUFFIX), nanos))
                    cost += nanos
        if cost:
            labelled(COST, name, route, backend).inc(cost / 1e9)
        if spent:
            if key is not None and key.tpm is not None:
                windows.append((window_name("tpm", name), MINUTE, spent))
            if key is not None and key.budget_tokens is not None:
                windows.append((window_name("budget", name), key.budget_period, spent))
            budget = self.budgets.get(backend)
            if budget is not None:
                windows.append((window_name("backend", backend), budget.period, spent))
            tokens_in = sum(n for kind, n in tokens if "input" in kind)
            observe_usage(scope.get("path") or "", route, tokens_in, spent - tokens_in, meter.begun)
        released = held.released() if held is not None else []
        if released:
            await self.store.usage_record(windows, totals, released=released)
        else:  # (a store of the older protocol, without holds, takes this call too)
            await self.store.usage_record(windows, totals)
        if spent:
            log_event(
                "usage.recorded",
                key_name=name,
                route=route,
                backend=backend,
                **{kind: amount for kind, amount in tokens if amount},
                cost=round(cost / 1e9, 9) if price is not None else None,
                cut=held.crossed if held is not None else None,
            )

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
        lines = formats.of(wire).lines  # (its usage on its last line; no terminator event)
        got_in, got_out = read_usage(wire, meter.values(lines))
        found = (
            None if got_in is None else bounded(got_in, "usage", backend),
            None if got_out is None else bounded(got_out, "usage", backend),
        )
        observer = req.observer if req is not None else None
        if meter.whole is not None:
            units = body_units(meter.size)
        elif meter.ended:  # ended here: what reached the caller, not what the attempt read
            units = meter.events
        else:
            units = observer.data_events if observer is not None else meter.chunks
            units = max(0, units - (0 if lines else 1))  # the terminator
        usage = estimate(found, len(req.body or b"") if req is not None else 0, units)
        ok = meter.ended or req is None or not req.attempts or req.attempts[-1].outcome == "ok"
        prefix = "" if ok else "failed_"
        return backend, [
            (
                f"{prefix}input{'_estimated' if usage.input_estimated and ok else ''}",
                bounded(usage.input, "estimate", backend),
            ),
            (
                f"{prefix}output{'_estimated' if usage.output_estimated and ok else ''}",
                bounded(usage.output, "estimate", backend),
            ),
        ]


class _Meter:
    """The send wrapper: keeps references to the chunks that can carry the usage, adds the
    ``x-ratelimit-*`` headers, and for a reserved stream counts its data events (a token
    each) and ends it once the key's token windows have no room left."""

    __slots__ = (
        "_send",
        "begun",
        "chunks",
        "ended",
        "events",
        "head",
        "headers",
        "held",
        "ndjson",
        "size",
        "status",
        "stream",
        "tail",
        "whole",
    )

    def __init__(
        self,
        send: Send,
        headers: list[tuple[bytes, bytes]] | None = None,
        held: _Held | None = None,
    ) -> None:
        self._send = send
        self.status: int | None = None
        self.stream = False
        self.ndjson = False
        self.head: list[bytes] = []
        self.tail: list[bytes] = []
        self.whole: list[bytes] | None = None
        self.size = 0
        self.chunks = 0
        self.headers = headers
        self.held = held
        self.ended = False
        self.events = 0  # data events passed on (counted only for a reserved stream)
        self.begun = clock.wall()

    def send(self, message: Message) -> Awaitable[None]:
        kind = message["type"]
        if kind == "http.response.body":
            if self.ended:
                return _nothing()
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
                else:
                    if len(self.head) < _HEAD:
                        self.head.append(chunk)
                    else:
                        tail = self.tail
                        tail.append(chunk)
                        if len(tail) > _TAIL:
                            del tail[0]
                    held = self.held
                    if held is not None:
                        events = (
                            chunk.count(b"\n")
                            if self.ndjson
                            else chunk.count(b"\ndata:") + (chunk[:5] == b"data:")
                        )
                        self.events += events
                        held.spent += events
                        if held.spent > held.held:
                            return self._grow(message, held, events)
        elif kind == "http.response.start":
            self.status = int(message["status"])
            for name, value in message.get("headers", ()):
                if name.lower() == b"content-type":
                    value = value.lower()
                    self.ndjson = b"ndjson" in value
                    self.stream = b"event-stream" in value or self.ndjson
            if not self.stream:
                self.whole = []
                self.held = None  # a whole answer is counted when it ends, never cut
            if self.headers:
                kept = [
                    (k, v)
                    for k, v in message.get("headers", ())
                    if not k.lower().startswith(b"x-ratelimit-")
                ]
                message = {**message, "headers": [*kept, *self.headers]}
        return self._send(message)

    async def _grow(self, message: Message, held: _Held, events: int) -> None:
        """A stream past what it holds: hold more; or pass on its events up to the one that
        crosses the key's limit, and end it there."""
        if self.ended:
            return
        room = await held.extend()
        if room or not message.get("more_body", False):
            return await self._send(message)
        self.ended = True
        keep = max(1, min(events, held.held - (held.spent - events) + 1))  # (the crossing one)
        if keep < events:
            chunk = message["body"]
            first = b"".join(chunk.splitlines(True)[:keep]) if self.ndjson else None
            message = {**message, "body": first or first_events(chunk, keep)}
            self.events -= events - keep
            held.spent -= events - keep
        await self._send(message)
        code = _REFUSALS[held.crossed or "tpm"][0]
        error = formats.of(held.wire).error_bytes(
            formats.NDJSON if self.ndjson else formats.SSE,
            f"the key's {'budget' if held.crossed == 'budget' else 'tokens per minute'} "
            "ran out mid-stream: the answer ends here",
            "rate_limit_error",
            code,
        )
        await self._send({"type": "http.response.body", "body": error, "more_body": False})
        held.cut.interrupt("tierchain: the key's token limit ran out mid-stream")

    def values(self, lines: bool) -> list[bytes]:
        """The JSON values that may carry the usage, in order (``lines``: the wire
        format's streams are NDJSON lines, its usage on the last)."""
        if self.whole is not None:
            return [b"".join(self.whole)] if self.size <= _HOLD_WHOLE else []
        if lines:
            return b"".join(self.tail or self.head).splitlines()[-2:]
        events = b"".join(self.head)
        values = data_values(events) if events else []
        if self.tail:
            values += data_values(b"".join(self.tail))
        return values


async def _nothing() -> None:
    """A send after the stream was ended here: nothing more reaches the caller."""


def _iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
