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

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import quote, unquote

from ._checks import duration
from ._runtime import clock
from .errors import StoreUnavailable
from .masking import mask_text, mask_url
from .store import (
    PROBE_BUSY_RETRY,
    SUSPECT_KEEP,
    USAGE_BOUND,
    BreakerChange,
    BreakerPolicy,
    BreakerSnapshot,
    MemoryStore,
    Outcome,
    Suspect,
    Ticket,
    WindowCheck,
    WindowHold,
)
from .telemetry import log_event

__all__ = ["RedisStore", "StoreUnavailable"]

T = TypeVar("T")

_NOW = """
local function now_ms(arg)
  if arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function num(v) if v then return tonumber(v) end return 0 end
local function keep(key, now, ou, pu, ttl)
  local horizon = math.max(ou, pu, now) - now
  redis.call('PEXPIRE', key, math.ceil(horizon + ttl))
end
"""

# KEYS[1] ledger; ARGV: now_ms|'' force lease_ms ttl_ms busy_ms wake
# -> {admitted, state, gen, probe, retry_in_ms|'', transitions, clean[, reason while open]}
_ACQUIRE = (
    _NOW
    + """
local key = KEYS[1]
local now = now_ms(ARGV[1])
local force = ARGV[2] == '1'
local lease = tonumber(ARGV[3])
local ttl = tonumber(ARGV[4])
local v = redis.call('HMGET', key, 'st', 'f', 's', 'ou', 'pu', 'pt', 'g', 'r')
if not v[1] then return {1, 'closed', 0, 0, '', '', 1} end
local st, f, s, ou = v[1], num(v[2]), num(v[3]), num(v[4])
local pu, pt, g = num(v[5]), num(v[6]), num(v[7])
local trans = ''
if ARGV[6] == '1' and st == 'open' and v[8] == 'saturation' and now < ou then
  ou = now
  redis.call('HSET', key, 'ou', tostring(ou))
end
if st == 'open' and now >= ou then
  st = 'half_open'
  trans = 'half_open'
  redis.call('HSET', key, 'st', st)
end
if st == 'closed' or force then
  local clean = 0
  if st == 'closed' and f == 0 and s == 0 then clean = 1 end
  return {1, st, g, 0, '', trans, clean}
end
if st == 'half_open' then
  if pu <= now then
    pt = pt + 1
    pu = now + lease
    redis.call('HSET', key, 'pu', tostring(pu), 'pt', pt)
    keep(key, now, ou, pu, ttl)
    return {1, st, g, pt, '', trans, 0}
  end
  return {0, st, g, 0, ARGV[5], trans, 0, v[8] or ''}
end
return {0, st, g, 0, tostring(ou - now), trans, 0, v[8] or ''}
"""
)

# KEYS[1] ledger; ARGV: now_ms|'' outcome gen probe retry_after_ms|'' f_threshold
# f_cooldown_ms s_threshold s_cooldown_ms cap_ms ttl_ms backoff_ms sf_threshold probe_every_ms
# -> {state, retry_in_ms|'', failures, saturations, transitions, reason}
_RECORD = (
    _NOW
    + """
local key = KEYS[1]
local now = now_ms(ARGV[1])
local outcome = ARGV[2]
local gen = tonumber(ARGV[3])
local probe = tonumber(ARGV[4])
local ra = nil
if ARGV[5] ~= '' then ra = tonumber(ARGV[5]) end
local fth, fcd = tonumber(ARGV[6]), tonumber(ARGV[7])
local sth, scd = tonumber(ARGV[8]), tonumber(ARGV[9])
local cap, ttl = tonumber(ARGV[10]), tonumber(ARGV[11])
local backoff = tonumber(ARGV[12])
local sfth, every = tonumber(ARGV[13]), tonumber(ARGV[14])
local v = redis.call('HMGET', key, 'st', 'f', 's', 'ou', 'pu', 'pt', 'g', 'r', 'ro', 'sf')
if not v[1] and (outcome == 'success' or outcome == 'neutral') then
  return {'closed', '', 0, 0, '', ''}
end
local st = v[1] or 'closed'
local f, s, ou, pu, pt, g = num(v[2]), num(v[3]), num(v[4]), num(v[5]), num(v[6]), num(v[7])
local r = v[8] or ''
local ro = num(v[9])
local sf = num(v[10])
local function failure_wait(reopens)
  if every <= 0 then return fcd end
  return math.min(fcd, every * (reopens + 1))
end
local trans = {}
if st == 'open' and now >= ou then
  st = 'half_open'
  table.insert(trans, 'half_open')
end
if probe ~= 0 and probe == pt then pu = 0 end
local fresh = gen == g
if outcome == 'success' then
  if fresh then
    f = 0
    s = 0
    sf = 0
    if st ~= 'closed' then
      st = 'closed'
      ou = 0
      pu = 0
      r = ''
      ro = 0
      table.insert(trans, 'closed')
    end
  end
elseif outcome == 'failure' or outcome == 'stream_failure' or outcome == 'saturation' then
  local kind, tripped
  if outcome ~= 'saturation' then
    f = f + 1
    kind = failure_wait(0)
    tripped = f >= fth
    if outcome == 'stream_failure' then
      sf = sf + 1
      if (not tripped) and sf >= sfth then
        tripped = true
      else
        outcome = 'failure'
      end
    end
  else
    s = s + 1
    kind = scd
    tripped = s >= sth
  end
  local cd = 0
  if tripped then cd = kind end
  local reason = outcome
  local hinted = 0
  if ra ~= nil then
    hinted = math.min(ra, cap)
    if (not tripped) or hinted > cd then reason = 'retry_after' end
    tripped = true
    cd = math.max(cd, hinted)
  end
  if st ~= 'closed' then
    tripped = fresh
    if outcome == 'saturation' then
      local grown = scd
      if backoff > 0 then grown = math.min(scd, backoff * (2 ^ math.min(ro, 60))) end
      cd = math.max(hinted, grown)
    else
      cd = math.max(hinted, failure_wait(ro + 1))
    end
    if fresh then ro = ro + 1 end
  end
  if tripped then
    if st ~= 'open' then
      g = g + 1
      pu = 0
      table.insert(trans, 'open')
    end
    st = 'open'
    if now + cd > ou then
      ou = now + cd
      r = reason
    end
  end
end
redis.call('HSET', key, 'st', st, 'f', f, 's', s, 'ou', tostring(ou), 'pu', tostring(pu),
  'pt', pt, 'g', g, 'r', r, 'ro', ro, 'sf', sf)
keep(key, now, ou, pu, ttl)
local retry = ''
if st == 'open' then retry = tostring(ou - now) end
return {st, retry, f, s, table.concat(trans, ','), r}
"""
)

# KEYS[1] ledger; ARGV: now_ms|'' -> {state, retry_in_ms|'', failures, saturations, reason}
_SNAPSHOT = (
    _NOW
    + """
local v = redis.call('HMGET', KEYS[1], 'st', 'f', 's', 'ou', 'r')
if not v[1] then return {'closed', '', 0, 0, ''} end
local now = now_ms(ARGV[1])
local st, ou = v[1], num(v[4])
if st == 'open' and now >= ou then st = 'half_open' end
local retry = ''
local reason = ''
if st == 'open' then
  retry = tostring(ou - now)
  reason = v[5] or ''
end
return {st, retry, num(v[2]), num(v[3]), reason}
"""
)


# What the lease scripts share: a lease set outlives the lease just taken or renewed twice over.
_LEASES = (
    _NOW
    + """
local function outlive(key, ttl)
  if redis.call('PTTL', key) < ttl * 2 then redis.call('PEXPIRE', key, math.ceil(ttl * 2)) end
end
"""
)

# KEYS[1] leases (a sorted set: token -> expiry ms); ARGV: now_ms|'' token limit ttl_ms force
# -> {taken, live}
_LEASE_ACQUIRE = (
    _LEASES
    + """
local key, now, ttl = KEYS[1], now_ms(ARGV[1]), tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
local n = redis.call('ZCARD', key)
if n >= tonumber(ARGV[3]) and ARGV[5] ~= '1' then return {0, n} end
redis.call('ZADD', key, now + ttl, ARGV[2])
outlive(key, ttl)
return {1, redis.call('ZCARD', key)}
"""
)

# KEYS[1] leases; ARGV: now_ms|'' ttl_ms token...
_LEASE_RENEW = (
    _LEASES
    + """
local key, now, ttl = KEYS[1], now_ms(ARGV[1]), tonumber(ARGV[2])
for i = 3, #ARGV do redis.call('ZADD', key, 'XX', now + ttl, ARGV[i]) end
outlive(key, ttl)
return 1
"""
)

# KEYS[1] leases; ARGV: now_ms|'' -> live
_LEASE_COUNT = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms(ARGV[1]))
return redis.call('ZCARD', KEYS[1])
"""
)


# What the window scripts share: sum one bucket hash over its window, dropping old buckets.
_WINDOWS = (
    _NOW
    + """
local function wsum(key, now, w)
  local width = w / 60
  local cur = math.floor(now / width)
  local oldest = cur - 59
  local flat = redis.call('HGETALL', key)
  local sum, first = 0, nil
  for j = 1, #flat, 2 do
    local b, v = tonumber(flat[j]), tonumber(flat[j + 1])
    if b < oldest then
      redis.call('HDEL', key, flat[j])
    else
      sum = sum + v
      if v > 0 and (first == nil or b < first) then first = b end
    end
  end
  return sum, first, cur, width
end
local function wadd(key, now, w, amount)
  local width = w / 60
  redis.call('HINCRBY', key, tostring(math.floor(now / width)), amount)
  redis.call('PEXPIRE', key, math.ceil(w * 2))
end
"""
)

# KEYS: one bucket hash per check; ARGV: now_ms|'' then window_ms limit cost fits per check
# -> {0 (admitted, costs added) | ms until there is room, index of the check, now_ms,
#     the sums (after the costs) joined by commas, the ms until each oldest bucket leaves}
_WINDOW_HOLD = (
    _WINDOWS
    + """
local now = now_ms(ARGV[1])
local wait, which = 0, 0
local used, reset = {}, {}
for i = 1, #KEYS do
  local b = i * 4 - 2
  local w, lim, cost = tonumber(ARGV[b]), tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
  local sum, first, cur, width = wsum(KEYS[i], now, w)
  local r = w
  if first then r = math.max(1, (first + 60) * width - now) end
  used[i], reset[i] = sum, r
  local full = sum >= lim
  if cost > 0 and ARGV[b + 3] == '1' then full = sum + cost > lim end
  if full and r > wait then wait, which = r, i end
end
if wait == 0 then
  for i = 1, #KEYS do
    local cost = tonumber(ARGV[i * 4])
    if cost > 0 then
      wadd(KEYS[i], now, tonumber(ARGV[i * 4 - 2]), cost)
      used[i] = used[i] + cost
    end
  end
end
for i = 1, #KEYS do
  used[i] = string.format('%d', used[i])
  reset[i] = tostring(reset[i])
end
return {tostring(wait), which - 1, tostring(now), table.concat(used, ','), table.concat(reset, ',')}
"""
)

# KEYS: the bucket hashes released, then those added to, then the totals hash last;
# ARGV: now_ms|'' ttl_ms n_released n_windows, window_ms amount at_ms per release,
# window_ms amount per window, then field amount per total
_USAGE_RECORD = (
    _WINDOWS
    + """
local now, ttl = now_ms(ARGV[1]), tonumber(ARGV[2])
local nr, n = tonumber(ARGV[3]), tonumber(ARGV[4])
local a = 5
for i = 1, nr do
  local w, amount, at = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  a = a + 3
  wsum(KEYS[i], now, w)
  local field = tostring(math.floor(at / (w / 60)))
  local held = tonumber(redis.call('HGET', KEYS[i], field) or '0')
  if held > amount then
    redis.call('HINCRBY', KEYS[i], field, -amount)
  elseif held > 0 then
    redis.call('HDEL', KEYS[i], field)
  end
end
for i = 1, n do
  local w = tonumber(ARGV[a])
  wsum(KEYS[nr + i], now, w)
  wadd(KEYS[nr + i], now, w, tonumber(ARGV[a + 1]))
  a = a + 2
end
local totals = KEYS[nr + n + 1]
for j = a, #ARGV, 2 do redis.call('HINCRBY', totals, ARGV[j], ARGV[j + 1]) end
if #ARGV >= a then redis.call('PEXPIRE', totals, ttl) end
return 1
"""
)

# KEYS: bucket hashes; ARGV: now_ms|'' then window_ms per key -> sums
_WINDOW_SUMS = (
    _WINDOWS
    + """
local now = now_ms(ARGV[1])
local out = {}
for i = 1, #KEYS do
  local sum = wsum(KEYS[i], now, tonumber(ARGV[i + 1]))
  out[i] = sum
end
return out
"""
)

# KEYS[1] mark; ARGV: now_ms|'' lease_ms -> {} (not suspect) or {why, retry_in_ms, probe, strikes}
_SUSPECT_CHECK = (
    _NOW
    + """
local key = KEYS[1]
local v = redis.call('HMGET', key, 'u', 's', 'w', 'p')
if not v[1] then return {} end
local now = now_ms(ARGV[1])
local u, s, p = tonumber(v[1]), num(v[2]), num(v[4])
if now < u then return {v[3], tostring(u - now), 0, s} end
if p > now then return {v[3], tostring(p - now), 0, s} end
redis.call('HSET', key, 'p', tostring(now + tonumber(ARGV[2])))
return {v[3], '0', 1, s}
"""
)

# KEYS[1] mark; ARGV: now_ms|'' why hold_ms keep_ms
_SUSPECT_MARK = (
    _NOW
    + """
local key = KEYS[1]
local now = now_ms(ARGV[1])
local hold = tonumber(ARGV[3])
local s = num(redis.call('HGET', key, 's')) + 1
redis.call('HSET', key, 'u', tostring(now + hold), 's', s, 'w', ARGV[2], 'p', '0')
redis.call('PEXPIRE', key, math.ceil(hold + tonumber(ARGV[4])))
return 1
"""
)

# KEYS[1] mark: give the probe slot back (the key is not made again once gone)
_SUSPECT_RELEASE = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'p', '0') end
return 1
"""


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


class RedisStore:
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
        try:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
            from redis.exceptions import ConnectionError as RedisConnectionError
            from redis.exceptions import ReadOnlyError, ResponseError
        except ImportError:
            raise ImportError(
                "RedisStore needs the redis package: install tierchain[redis]."
            ) from None
        self.url = url
        self.prefix = prefix
        self.timeout = duration("timeout", timeout)
        self.reconnect_every = duration("reconnect_every", reconnect_every)
        self.ttl = duration("ttl", ttl, at_least=1.0)
        self._clock = clock
        # One immediate retry lets a pooled connection that died with a Redis
        # restart be replaced transparently; no backoff, so a dead Redis costs
        # two refused connects, not seconds. Only a broken connection is
        # retried: a reply that is late may belong to a script Redis already
        # ran, and sending it again would count one outcome twice.
        self._redis: Any = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            decode_responses=True,
        )
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._record = self._redis.register_script(_RECORD)
        self._snapshot = self._redis.register_script(_SNAPSHOT)
        self._lease_acquire = self._redis.register_script(_LEASE_ACQUIRE)
        self._lease_renew = self._redis.register_script(_LEASE_RENEW)
        self._lease_count = self._redis.register_script(_LEASE_COUNT)
        self._window_hold = self._redis.register_script(_WINDOW_HOLD)
        self._usage_record = self._redis.register_script(_USAGE_RECORD)
        self._window_sums = self._redis.register_script(_WINDOW_SUMS)
        self._suspect_check = self._redis.register_script(_SUSPECT_CHECK)
        self._suspect_mark = self._redis.register_script(_SUSPECT_MARK)
        self._suspect_release = self._redis.register_script(_SUSPECT_RELEASE)
        self._refusals: tuple[type[BaseException], ...] = (ResponseError,)
        # A read-only replica (Redis failing over) refuses every write: an outage.
        self._outages: tuple[type[BaseException], ...] = (ReadOnlyError,)
        self._fallback: MemoryStore | None = None
        self._retry_at = 0.0
        self._tasks: set[asyncio.Task[Any]] = set()

    def __repr__(self) -> str:
        return f"RedisStore(url={mask_url(self.url)!r}, prefix={self.prefix!r})"

    # -- lifecycle ------------------------------------------------------------

    async def aclose(self) -> None:
        """Wait for in-flight records, then close the connection pool."""
        # Until none is left: a record's task may start another as it ends (a cancelled
        # acquire gives its probe slot back from its done-callback).
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._redis.aclose()

    async def __aenter__(self) -> RedisStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def degraded(self) -> bool:
        """True while Redis is unreachable and the local fallback is serving."""
        return self._fallback is not None

    # -- the outage machinery ---------------------------------------------------

    def _local(self) -> MemoryStore | None:
        """The fallback to use now, or None when Redis should be tried."""
        fallback = self._fallback
        if fallback is None:
            return None
        now = clock.now()
        if now < self._retry_at:
            return fallback
        self._retry_at = now + self.reconnect_every  # this caller tries; the rest wait
        return None

    def _went_away(self, exc: BaseException, what: str = "") -> MemoryStore:
        """The fallback for an outage; an error reply (Redis refused this one call: a
        script error, a value it cannot take) is no outage: it is logged and raised,
        and every other call goes on reaching Redis."""
        if isinstance(exc, self._refusals) and not isinstance(exc, self._outages):
            self._came_back()  # Redis answered
            log_event(
                "store.redis_refused",
                level=30,
                url=mask_url(self.url),
                call=what or None,
                error=mask_text(repr(exc), self.url),
            )
            raise exc
        self._retry_at = clock.now() + self.reconnect_every
        if self._fallback is None:
            self._fallback = MemoryStore(clock=self._clock or clock.wall)
            log_event(
                "store.redis_unavailable",
                level=30,
                url=mask_url(self.url),
                error=mask_text(repr(exc), self.url),
                fallback="local memory",
                reconnect_every_s=self.reconnect_every,
            )
        return self._fallback

    def _came_back(self) -> None:
        if self._fallback is not None:
            self._fallback = None
            log_event("store.redis_reconnected", url=mask_url(self.url))

    async def _call(self, make: Callable[[], Awaitable[T]]) -> T:
        async with asyncio.timeout(self.timeout * 4):
            result = await make()
        self._came_back()
        return result

    async def _shielded(
        self, make: Callable[[], Awaitable[T]], orphan: Callable[[T], None] | None = None
    ) -> T:
        """Run a Redis call that must finish even if its caller is cancelled meanwhile."""
        task = asyncio.ensure_future(self._call(make))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if orphan is not None:
                task.add_done_callback(
                    lambda t: (
                        orphan(t.result()) if not t.cancelled() and not t.exception() else None
                    )
                )
            raise

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

    async def fact_get(self, backend: str, name: str) -> str | None:
        local = self._local()
        if local is not None:
            return await local.fact_get(backend, name)
        key = self._fact_key(backend, name)
        try:
            value = await self._call(lambda: self._redis.get(key))
        except Exception as exc:
            return await self._went_away(exc).fact_get(backend, name)
        return None if value is None else _text(value)

    async def fact_put(self, backend: str, name: str, value: str, ttl: float) -> None:
        local = self._local()
        if local is not None:
            return await local.fact_put(backend, name, value, ttl)
        key = self._fact_key(backend, name)
        try:
            await self._shielded(lambda: self._redis.set(key, value, px=max(1, int(ttl * 1000))))
        except Exception as exc:
            await self._went_away(exc).fact_put(backend, name, value, ttl)

    async def normals_get(self, backend: str) -> str | None:
        local = self._local()
        if local is not None:
            return await local.normals_get(backend)
        key = self._normals_key(backend)
        try:
            value = await self._call(lambda: self._redis.get(key))
        except Exception as exc:
            return await self._went_away(exc).normals_get(backend)
        return None if value is None else _text(value)

    async def normals_put(self, backend: str, value: str, ttl: float) -> None:
        local = self._local()
        if local is not None:
            return await local.normals_put(backend, value, ttl)
        key = self._normals_key(backend)
        try:
            await self._shielded(lambda: self._redis.set(key, value, px=max(1, int(ttl * 1000))))
        except Exception as exc:
            await self._went_away(exc).normals_put(backend, value, ttl)

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

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- pins --------------------------------------------------------------------

    def _unreachable(self, what: str, exc: BaseException) -> StoreUnavailable:
        return StoreUnavailable(
            f"{what}: Redis at {mask_url(self.url)} is unreachable "
            f"({mask_text(repr(exc), self.url)})"
        )

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
        local = self._local()
        if local is not None:
            return await local.get_pin(route)
        key = self._pin_key(route)
        try:
            value = await self._call(lambda: self._redis.get(key))
        except Exception as exc:
            return await self._went_away(exc).get_pin(route)
        return None if value is None else _text(value)

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
