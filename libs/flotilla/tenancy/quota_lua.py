"""The two Lua scripts of the Redis quota store. Each runs atomically in Redis, on Redis's clock (TIME),
so every gateway sees one window per tenant.

Keys (one hash tag per tenant, so a cluster keeps them on one slot):
  log  ZSET   reservation id -> time reserved (ms): the requests in the window
  amt  HASH   reservation id -> tokens it holds now (reserved, then actual after settling)
  sum  STRING total tokens held by the window (sum of amt)
  conc ZSET   reservation id -> lease expiry (ms): requests in flight
"""

RESERVE = """
local log, amt, sum, conc = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local rid, cost = ARGV[1], tonumber(ARGV[2])
local tpm, rpm, maxc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local window, lease, conc_retry = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- slide the window: forget reservations older than a minute, and the tokens they held
local expired = redis.call('ZRANGEBYSCORE', log, '-inf', now - window)
if #expired > 0 then
  local freed = 0
  for _, member in ipairs(expired) do
    freed = freed + tonumber(redis.call('HGET', amt, member) or '0')
    redis.call('HDEL', amt, member)
  end
  redis.call('ZREMRANGEBYSCORE', log, '-inf', now - window)
  redis.call('DECRBY', sum, freed)
end
redis.call('ZREMRANGEBYSCORE', conc, '-inf', now)

local used = tonumber(redis.call('GET', sum) or '0')
local nreq = redis.call('ZCARD', log)
local reason, retry = '', 0
if tpm > 0 and cost > tpm then
  reason = 'too_large'
elseif maxc > 0 and redis.call('ZCARD', conc) >= maxc then
  reason, retry = 'concurrency', conc_retry
elseif rpm > 0 and nreq >= rpm then
  -- the request that must leave the window before one more fits
  local gone = redis.call('ZRANGE', log, nreq - rpm, nreq - rpm, 'WITHSCORES')
  reason, retry = 'requests', tonumber(gone[2]) + window - now
elseif tpm > 0 and used + cost > tpm then
  local need, freeing = used + cost - tpm, 0
  local entries = redis.call('ZRANGE', log, 0, -1, 'WITHSCORES')
  for i = 1, #entries, 2 do
    freeing = freeing + tonumber(redis.call('HGET', amt, entries[i]) or '0')
    if freeing >= need then
      retry = tonumber(entries[i + 1]) + window - now
      break
    end
  end
  reason = 'tokens'
end
if reason == '' then
  redis.call('ZADD', log, now, rid)
  redis.call('HSET', amt, rid, cost)
  used = redis.call('INCRBY', sum, cost)
  nreq = nreq + 1
  if maxc > 0 then
    redis.call('ZADD', conc, now + lease, rid)
  end
end
for _, key in ipairs(KEYS) do
  redis.call('PEXPIRE', key, window + lease)
end
local tokens_reset, requests_reset = 0, 0
local newest = redis.call('ZRANGE', log, -1, -1, 'WITHSCORES')
if #newest > 0 then tokens_reset = tonumber(newest[2]) + window - now end
local oldest = redis.call('ZRANGE', log, 0, 0, 'WITHSCORES')
if #oldest > 0 then requests_reset = tonumber(oldest[2]) + window - now end
if reason == '' then
  return {1, reason, 0, used, nreq, tokens_reset, requests_reset}
end
return {0, reason, retry, used, nreq, tokens_reset, requests_reset}
"""

SETTLE = """
local amt, sum, conc = KEYS[2], KEYS[3], KEYS[4]
local rid, used = ARGV[1], tonumber(ARGV[2])
redis.call('ZREM', conc, rid)
local reserved = redis.call('HGET', amt, rid)
if not reserved then
  return 0  -- it left the window already: nothing is held any more
end
local refund = tonumber(reserved) - used
if refund <= 0 then
  return 0
end
redis.call('HSET', amt, rid, used)
redis.call('DECRBY', sum, refund)
return refund
"""
