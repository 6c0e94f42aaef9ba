"""The Lua scripts RedisStore runs: each the Redis copy of one rule of the memory store.

Each script runs atomically in Redis, so two replicas never both take a half-open probe slot,
a lease past the limit or room a window does not have. Each is the transcription of a rule
kept in Python beside :class:`~tierchain.MemoryStore`: ``ACQUIRE``, ``RECORD`` and
``SNAPSHOT`` of :mod:`tierchain.breaker_state` (the breaker machine); ``LEASE_*`` of the
in-flight leases; ``WINDOW_HOLD``, ``USAGE_RECORD`` and ``WINDOW_SUMS`` of
:mod:`tierchain.windows` (the sliding windows); ``SUSPECT_*`` of :mod:`tierchain.suspects`
(the suspect marks). A change to a rule is made in both places; ``tests/test_breaker_model.py``
and ``tests/test_stores.py`` run both stores against the same model. The comment above each
script says its keys, its arguments and its answer; times are milliseconds, from Redis's own
``TIME`` unless the first argument gives one (a test's clock).
"""

from __future__ import annotations

__all__ = [
    "ACQUIRE",
    "LEASE_ACQUIRE",
    "LEASE_COUNT",
    "LEASE_RENEW",
    "RECORD",
    "SNAPSHOT",
    "SUSPECT_CHECK",
    "SUSPECT_MARK",
    "SUSPECT_RELEASE",
    "USAGE_RECORD",
    "WINDOW_HOLD",
    "WINDOW_SUMS",
]

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
ACQUIRE = (
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
RECORD = (
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
SNAPSHOT = (
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
LEASE_ACQUIRE = (
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
LEASE_RENEW = (
    _LEASES
    + """
local key, now, ttl = KEYS[1], now_ms(ARGV[1]), tonumber(ARGV[2])
for i = 3, #ARGV do redis.call('ZADD', key, 'XX', now + ttl, ARGV[i]) end
outlive(key, ttl)
return 1
"""
)

# KEYS[1] leases; ARGV: now_ms|'' -> live
LEASE_COUNT = (
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
WINDOW_HOLD = (
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
USAGE_RECORD = (
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
WINDOW_SUMS = (
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
SUSPECT_CHECK = (
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
SUSPECT_MARK = (
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
SUSPECT_RELEASE = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'p', '0') end
return 1
"""
