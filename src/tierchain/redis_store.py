"""RedisStore: the breaker ledgers and pins, shared by every replica of a gateway.

Each breaker transition is one Lua script run atomically by Redis, so two
replicas can never both take the half-open probe slot. An attempt costs one
script call before it and, only when there is something to record, one after.

Times come from Redis's own ``TIME`` inside the scripts, the one clock every
replica shares (``clock=`` replaces it, for tests only): epoch seconds, so the
fallback while Redis is away and a pin's expiry read the package's wall clock
(``clock.wall``); the wait before Redis is tried again is on the package's one
monotonic clock (``clock.now``), as every wait is. Keys live under
``prefix`` (``tierchain:``): ``tierchain:breaker:<route>:<backend>`` (a hash)
and ``tierchain:pin:<route>`` (a string); route and backend names are
percent-encoded; in-flight leases are a sorted set per backend,
``tierchain:inflight:<backend>`` (member: the lease token, score: its expiry);
a pool's prefix affinity is a string per prompt-prefix hash,
``tierchain:affinity:<route>:<hash>`` (the replica that served it); a windowed
counter (per-key limits, budgets) is a hash of buckets,
``tierchain:window:<name>`` (field: the bucket number, value: its amount), and
the usage totals one hash, ``tierchain:usage`` (field: key, route, backend and
kind; value: tokens or attempts); a backend's learned normals are a string,
``tierchain:normals:<backend>``, its suspect mark a hash,
``tierchain:suspect:<backend>`` (until, strikes, why, probe slot), and a fact
found out about it a string, ``tierchain:fact:<name>:<backend>`` (whether it
continues a trailing assistant message: ``prefill``).
Every key carries a TTL, so nothing lingers forever.

When Redis cannot be reached, the store logs ONE warning, serves breaker
operations and pin reads from a local :class:`~tierchain.MemoryStore` for the
outage, and tries Redis again at most every ``reconnect_every`` seconds (one
request tries; the rest stay on the fallback meanwhile). Pin *writes* during an
outage raise :class:`StoreUnavailable` instead: an operator must not believe a
pin reached every replica when it did not. An error *reply* (Redis refused one
script: a value it cannot take, a key of the wrong type) is no outage: that one
call raises, logged as ``store.redis_refused``, and every other call still goes
to Redis (a read-only replica, Redis failing over, counts as an outage).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import quote, unquote

from . import redis_scripts as lua
from ._checks import duration
from ._runtime import clock
from .breaker_state import (
    PROBE_BUSY_RETRY,
    BreakerChange,
    BreakerPolicy,
    BreakerSnapshot,
    Outcome,
    Ticket,
)
from .errors import StoreUnavailable
from .memory_store import MemoryStore
from .redis_link import RedisLink
from .suspects import SUSPECT_KEEP, Suspect
from .windows import USAGE_BOUND, WindowCheck, WindowHold

__all__ = ["RedisStore", "StoreUnavailable"]


def _ms(seconds: float) -> str:
    return repr(seconds * 1000.0)


def _seconds(ms: Any) -> float | None:
    if ms in (None, "", b""):
        return None
    return max(0.0, float(ms) / 1000.0)


def _bounded(amount: int) -> int:
    """An amount as a script may take it: within +-USAGE_BOUND (a Redis integer past 2^63,
    or a Lua double past 2^53, would be refused or rounded; the callers bound theirs
    already, this is the last guard)."""
    return max(-USAGE_BOUND, min(USAGE_BOUND, int(amount)))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _transitions(value: Any) -> tuple[str, ...]:
    text = _text(value)
    return tuple(text.split(",")) if text else ()


class RedisStore(RedisLink):
    """Breaker ledgers and pins in Redis, shared by every replica (the ``redis`` extra).

    ``timeout`` bounds each Redis call (connect and command), ``reconnect_every``
    is the least time between two attempts to reach a Redis that went away,
    ``ttl`` is how long an idle ledger is kept once its cooldown is over.
    ``clock`` (seconds) replaces Redis's ``TIME``; it is for tests only, since
    replicas must share one clock. Close it with ``await store.aclose()``.

    Options: [RedisStore](stores.md#redisstore).
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "tierchain:",
        timeout: float | timedelta = 0.25,
        reconnect_every: float | timedelta = 5.0,
        ttl: float | timedelta = 86400.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(
            url,
            prefix,
            duration("timeout", timeout),
            duration("reconnect_every", reconnect_every),
            duration("ttl", ttl, at_least=1.0),
            clock,
        )
        self._acquire = self._redis.register_script(lua.ACQUIRE)
        self._record = self._redis.register_script(lua.RECORD)
        self._snapshot = self._redis.register_script(lua.SNAPSHOT)
        self._lease_acquire = self._redis.register_script(lua.LEASE_ACQUIRE)
        self._lease_renew = self._redis.register_script(lua.LEASE_RENEW)
        self._lease_count = self._redis.register_script(lua.LEASE_COUNT)
        self._window_hold = self._redis.register_script(lua.WINDOW_HOLD)
        self._usage_record = self._redis.register_script(lua.USAGE_RECORD)
        self._window_sums = self._redis.register_script(lua.WINDOW_SUMS)
        self._suspect_check = self._redis.register_script(lua.SUSPECT_CHECK)
        self._suspect_mark = self._redis.register_script(lua.SUSPECT_MARK)
        self._suspect_release = self._redis.register_script(lua.SUSPECT_RELEASE)

    def _args(self) -> str:
        return "" if self._clock is None else _ms(self._clock())

    def _key(self, route: str, backend: str) -> str:
        return f"{self.prefix}breaker:{quote(route, safe='')}:{quote(backend, safe='')}"

    def _pin_key(self, route: str) -> str:
        return f"{self.prefix}pin:{quote(route, safe='')}"

    # -- breaker -------------------------------------------------------------

    async def breaker_acquire(
        self,
        route: str,
        backend: str,
        policy: BreakerPolicy,
        *,
        force: bool = False,
        wake: bool = False,
    ) -> Ticket:
        local = self._local()
        if local is not None:
            return await local.breaker_acquire(route, backend, policy, force=force, wake=wake)
        key = self._key(route, backend)
        args = [
            self._args(),
            "1" if force else "0",
            _ms(policy.probe_lease),
            _ms(self.ttl),
            _ms(PROBE_BUSY_RETRY),
            "1" if wake else "0",
        ]

        def orphan(ticket: Ticket) -> None:
            if ticket.probe:  # the caller left holding the probe slot: give it back
                self._spawn(self.breaker_record(route, backend, policy, "neutral", **_of(ticket)))

        try:
            raw = await self._shielded(lambda: self._acquire(keys=[key], args=args), _wrap(orphan))
        except Exception as exc:
            local = self._went_away(exc)
            return await local.breaker_acquire(route, backend, policy, force=force, wake=wake)
        admitted, state, gen, probe, retry_ms, transitions, clean = raw[:7]
        return Ticket(
            bool(int(admitted)),
            _text(state),
            int(gen),
            int(probe),
            _seconds(retry_ms),
            _transitions(transitions),
            bool(int(clean)),
            _text(raw[7]) if len(raw) > 7 else "",
        )

    async def breaker_record(
        self,
        route: str,
        backend: str,
        policy: BreakerPolicy,
        outcome: Outcome,
        *,
        gen: int,
        probe: int = 0,
        retry_after: float | None = None,
    ) -> BreakerChange:
        local = self._local()
        if local is not None:
            return await local.breaker_record(
                route, backend, policy, outcome, gen=gen, probe=probe, retry_after=retry_after
            )
        key = self._key(route, backend)
        args = [
            self._args(),
            outcome,
            str(gen),
            str(probe),
            "" if retry_after is None else _ms(retry_after),
            str(policy.failure_threshold),
            _ms(policy.failure_cooldown),
            str(policy.saturation_threshold),
            _ms(policy.saturation_cooldown),
            _ms(policy.retry_after_cap),
            _ms(self.ttl),
            _ms(policy.saturation_backoff),
            str(policy.stream_failure_threshold),
            _ms(policy.probe_every),
        ]
        try:
            raw = await self._shielded(lambda: self._record(keys=[key], args=args))
        except Exception as exc:
            local = self._went_away(exc)
            return await local.breaker_record(
                route, backend, policy, outcome, gen=gen, probe=probe, retry_after=retry_after
            )
        state, retry_ms, failures, saturations, transitions, reason = raw
        if outcome == "success":  # it served again: no longer suspect (MemoryStore's rule)
            self._spawn(self.suspect_end(backend, healthy=True))
        return BreakerChange(
            _text(state),
            _seconds(retry_ms),
            int(failures),
            int(saturations),
            _transitions(transitions),
            _text(reason),
        )

    async def breaker_snapshot(self, route: str, backend: str) -> BreakerSnapshot:
        local = self._local()
        if local is not None:
            return await local.breaker_snapshot(route, backend)
        key = self._key(route, backend)
        try:
            raw = await self._call(lambda: self._snapshot(keys=[key], args=[self._args()]))
        except Exception as exc:
            return await self._went_away(exc).breaker_snapshot(route, backend)
        state, retry_ms, failures, saturations = raw[:4]
        reason = _text(raw[4]) if len(raw) > 4 else ""
        return BreakerSnapshot(
            _text(state), _seconds(retry_ms), int(failures), int(saturations), reason
        )

    # -- in-flight leases -------------------------------------------------------

    def _lease_key(self, backend: str) -> str:
        return f"{self.prefix}inflight:{quote(backend, safe='')}"

    async def lease_acquire(
        self, backend: str, token: str, limit: int, ttl: float, *, force: bool = False
    ) -> tuple[bool, int]:
        local = self._local()
        if local is not None:
            return await local.lease_acquire(backend, token, limit, ttl, force=force)
        key = self._lease_key(backend)
        args = [self._args(), token, str(limit), _ms(ttl), "1" if force else "0"]

        def orphan(raw: Any) -> None:
            if int(raw[0]):  # the caller left holding a lease: give it back
                self._spawn(self.lease_release(backend, token))

        try:
            raw = await self._shielded(lambda: self._lease_acquire(keys=[key], args=args), orphan)
        except Exception as exc:
            local = self._went_away(exc)
            return await local.lease_acquire(backend, token, limit, ttl, force=force)
        return bool(int(raw[0])), int(raw[1])

    async def lease_renew(self, backend: str, tokens: list[str], ttl: float) -> None:
        local = self._local()
        if local is not None:
            return await local.lease_renew(backend, tokens, ttl)
        key = self._lease_key(backend)
        args = [self._args(), _ms(ttl), *tokens]
        try:
            await self._call(lambda: self._lease_renew(keys=[key], args=args))
        except Exception as exc:
            await self._went_away(exc).lease_renew(backend, tokens, ttl)

    async def lease_release(self, backend: str, token: str) -> None:
        local = self._local()
        if local is not None:
            return await local.lease_release(backend, token)
        key = self._lease_key(backend)
        try:
            await self._shielded(lambda: self._redis.zrem(key, token))
        except Exception as exc:  # it runs out by itself
            await self._went_away(exc).lease_release(backend, token)

    async def lease_count(self, backend: str) -> int:
        local = self._local()
        if local is not None:
            return await local.lease_count(backend)
        key = self._lease_key(backend)
        try:
            return int(await self._call(lambda: self._lease_count(keys=[key], args=[self._args()])))
        except Exception as exc:
            return await self._went_away(exc).lease_count(backend)

    # -- prefix affinity ---------------------------------------------------------------

    def _affinity_key(self, route: str, key: str) -> str:
        return f"{self.prefix}affinity:{quote(route, safe='')}:{key}"

    async def affinity_get(self, route: str, keys: Sequence[str]) -> str | None:
        local = self._local()
        if local is not None:
            return await local.affinity_get(route, keys)
        if not keys:
            return None
        names = [self._affinity_key(route, k) for k in keys]
        try:
            values = await self._call(lambda: self._redis.mget(names))
        except Exception as exc:
            return await self._went_away(exc).affinity_get(route, keys)
        return next((v for v in values if v is not None), None)

    async def affinity_set(self, route: str, keys: Sequence[str], backend: str, ttl: float) -> None:
        local = self._local()
        if local is not None:
            return await local.affinity_set(route, keys, backend, ttl)

        async def write() -> None:
            async with self._redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.set(self._affinity_key(route, key), backend, px=max(1, int(ttl * 1000)))
                await pipe.execute()

        try:
            await self._shielded(write)
        except Exception as exc:
            await self._went_away(exc).affinity_set(route, keys, backend, ttl)

    # -- windowed counters and usage totals ---------------------------------------------

    def _window_key(self, name: str) -> str:
        return f"{self.prefix}window:{quote(name, safe='')}"

    async def window_admit(self, checks: Sequence[WindowCheck]) -> tuple[float, int] | None:
        return (await self.window_hold(checks)).refused

    async def window_hold(self, checks: Sequence[WindowCheck]) -> WindowHold:
        local = self._local()
        if local is not None:
            return await local.window_hold(checks)
        keys = [self._window_key(c.name) for c in checks]
        args = [self._args()]
        for c in checks:
            args += [_ms(c.window), str(_bounded(c.limit)), str(_bounded(c.cost))]
            args.append("1" if c.fits else "0")
        try:
            raw = await self._shielded(lambda: self._window_hold(keys=keys, args=args))
        except Exception as exc:
            return await self._went_away(exc, "window_hold").window_hold(checks)
        wait, which, now, used, reset = (_text(v) for v in raw)
        waited = _seconds(wait)
        return WindowHold(
            (waited or 0.001, int(which)) if waited else None,
            float(now) / 1000.0,
            tuple(int(v) for v in used.split(",")) if used else (),
            tuple(float(v) / 1000.0 for v in reset.split(",")) if reset else (),
        )

    async def usage_record(
        self,
        windows: Sequence[tuple[str, float, int]],
        totals: Sequence[tuple[str, int]],
        released: Sequence[tuple[str, float, int, float]] = (),
    ) -> None:
        local = self._local()
        if local is not None:
            return await local.usage_record(windows, totals, released)
        keys = [self._window_key(n) for n, _, _, _ in released]
        keys += [self._window_key(n) for n, _, _ in windows] + [f"{self.prefix}usage"]
        args = [self._args(), _ms(self.ttl), str(len(released)), str(len(windows))]
        for _, window, amount, at in released:
            # (the script's own time, back to the ms it was: a float's last bit must not
            # move a hold into the bucket before its own)
            args += [_ms(window), str(_bounded(amount)), repr(round(at * 1000.0, 3))]
        for _, window, amount in windows:
            args += [_ms(window), str(_bounded(amount))]
        for field_name, amount in totals:
            args += [field_name, str(_bounded(amount))]
        try:
            await self._shielded(lambda: self._usage_record(keys=keys, args=args))
        except Exception as exc:
            await self._went_away(exc, "usage_record").usage_record(windows, totals, released)

    async def window_sums(self, windows: Sequence[tuple[str, float]]) -> list[int]:
        local = self._local()
        if local is not None:
            return await local.window_sums(windows)
        keys = [self._window_key(n) for n, _ in windows]
        args = [self._args(), *(_ms(w) for _, w in windows)]
        try:
            raw = await self._call(lambda: self._window_sums(keys=keys, args=args))
        except Exception as exc:
            return await self._went_away(exc).window_sums(windows)
        return [int(v) for v in raw]

    async def usage_totals(self) -> dict[str, int]:
        local = self._local()
        if local is not None:
            return await local.usage_totals()
        try:
            raw = await self._call(lambda: self._redis.hgetall(f"{self.prefix}usage"))
        except Exception as exc:
            return await self._went_away(exc).usage_totals()
        return {_text(k): int(v) for k, v in raw.items()}

    # -- learned normals and suspect marks -----------------------------------------------

    def _normals_key(self, backend: str) -> str:
        return f"{self.prefix}normals:{quote(backend, safe='')}"

    def _suspect_key(self, backend: str) -> str:
        return f"{self.prefix}suspect:{quote(backend, safe='')}"

    # -- facts found out about a backend ------------------------------------------------

    def _fact_key(self, backend: str, name: str) -> str:
        return f"{self.prefix}fact:{quote(name, safe='')}:{quote(backend, safe='')}"

    async def _get(
        self, key: str, fallback: Callable[[MemoryStore], Awaitable[str | None]]
    ) -> str | None:
        """The string at ``key``, or what ``fallback`` reads from the memory store while Redis
        is away."""
        local = self._local()
        if local is not None:
            return await fallback(local)
        try:
            value = await self._call(lambda: self._redis.get(key))
        except Exception as exc:
            return await fallback(self._went_away(exc))
        return None if value is None else _text(value)

    async def _put(
        self,
        key: str,
        value: str,
        ttl: float,
        fallback: Callable[[MemoryStore], Awaitable[None]],
    ) -> None:
        """Write the string ``value`` at ``key`` for ``ttl`` seconds, or through ``fallback``
        into the memory store while Redis is away."""
        local = self._local()
        if local is not None:
            return await fallback(local)
        try:
            await self._shielded(lambda: self._redis.set(key, value, px=max(1, int(ttl * 1000))))
        except Exception as exc:
            await fallback(self._went_away(exc))

    async def fact_get(self, backend: str, name: str) -> str | None:
        key = self._fact_key(backend, name)
        return await self._get(key, lambda local: local.fact_get(backend, name))

    async def fact_put(self, backend: str, name: str, value: str, ttl: float) -> None:
        key = self._fact_key(backend, name)
        await self._put(key, value, ttl, lambda local: local.fact_put(backend, name, value, ttl))

    async def normals_get(self, backend: str) -> str | None:
        key = self._normals_key(backend)
        return await self._get(key, lambda local: local.normals_get(backend))

    async def normals_put(self, backend: str, value: str, ttl: float) -> None:
        key = self._normals_key(backend)
        await self._put(key, value, ttl, lambda local: local.normals_put(backend, value, ttl))

    async def suspect_check(self, backend: str, lease: float) -> Suspect | None:
        local = self._local()
        if local is not None:
            return await local.suspect_check(backend, lease)
        key = self._suspect_key(backend)
        args = [self._args(), _ms(lease)]

        def orphan(raw: Any) -> None:
            if raw and int(raw[2]):  # the caller left holding the probe slot: give it back
                self._spawn(self.suspect_end(backend, healthy=False))

        try:
            raw = await self._shielded(lambda: self._suspect_check(keys=[key], args=args), orphan)
        except Exception as exc:
            return await self._went_away(exc).suspect_check(backend, lease)
        if not raw:
            return None
        why, retry_ms, probe, strikes = raw
        return Suspect(_text(why), _seconds(retry_ms) or 0.0, bool(int(probe)), int(strikes))

    async def suspect_mark(self, backend: str, why: str, hold: float) -> None:
        local = self._local()
        if local is not None:
            return await local.suspect_mark(backend, why, hold)
        key = self._suspect_key(backend)
        args = [self._args(), why, _ms(hold), _ms(SUSPECT_KEEP)]
        try:
            await self._shielded(lambda: self._suspect_mark(keys=[key], args=args))
        except Exception as exc:
            await self._went_away(exc).suspect_mark(backend, why, hold)

    async def suspect_end(self, backend: str, *, healthy: bool) -> None:
        local = self._local()
        if local is not None:
            return await local.suspect_end(backend, healthy=healthy)
        key = self._suspect_key(backend)
        try:
            if healthy:
                await self._shielded(lambda: self._redis.delete(key))
            else:
                await self._shielded(lambda: self._suspect_release(keys=[key], args=[]))
        except Exception as exc:
            await self._went_away(exc).suspect_end(backend, healthy=healthy)

    # -- pins --------------------------------------------------------------------

    async def set_pin(self, route: str, backend: str, ttl: float) -> float:
        ttl = duration("ttl", ttl)
        key = self._pin_key(route)
        try:
            await self._call(lambda: self._redis.set(key, backend, px=max(1, round(ttl * 1000))))
        except Exception as exc:
            self._went_away(exc)
            raise self._unreachable("the pin was not set", exc) from exc
        return clock.wall() + ttl

    async def delete_pin(self, route: str) -> bool:
        key = self._pin_key(route)
        try:
            removed = await self._call(lambda: self._redis.delete(key))
        except Exception as exc:
            self._went_away(exc)
            raise self._unreachable("the pin was not removed", exc) from exc
        return bool(removed)

    async def get_pin(self, route: str) -> str | None:
        return await self._get(self._pin_key(route), lambda local: local.get_pin(route))

    async def list_pins(self) -> dict[str, tuple[str, float]]:
        local = self._local()
        if local is not None:
            return await local.list_pins()
        try:
            return await self._call(self._list_pins)
        except Exception as exc:
            return await self._went_away(exc).list_pins()

    async def _list_pins(self) -> dict[str, tuple[str, float]]:
        start = len(self.prefix) + len("pin:")
        keys = [k async for k in self._redis.scan_iter(match=f"{self.prefix}pin:*", count=100)]
        if not keys:
            return {}
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.get(key)
                pipe.pttl(key)
            values = await pipe.execute()
        pins: dict[str, tuple[str, float]] = {}
        for key, value, pttl in zip(keys, values[::2], values[1::2], strict=True):
            if value is not None and pttl is not None and int(pttl) > 0:
                pins[unquote(_text(key)[start:])] = (_text(value), int(pttl) / 1000.0)
        return pins


def _of(ticket: Ticket) -> dict[str, Any]:
    return {"gen": ticket.gen, "probe": ticket.probe}


def _wrap(orphan: Callable[[Ticket], None]) -> Callable[[Any], None]:
    def on_raw(raw: Any) -> None:
        ticket = Ticket(True, _text(raw[1]), int(raw[2]), int(raw[3]))
        orphan(ticket)

    return on_raw
