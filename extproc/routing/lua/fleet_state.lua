-- Read-only: the fleet state of one model, for the metrics collector and `iris-extproc status`
-- (extproc/fleet_state.py). Not a routing transition: it writes nothing and needs no lib.lua.
-- KEYS: [2i-1] provider i's live pins of this model (zset: pin id -> pin expiry, ms)
--       [2i]   provider i's leases of this model (zset: lease id -> lease deadline, ms)
--       then the degraded flags to read (strings with a TTL)
-- ARGV: [1] n providers (the number of pins/leases key pairs)
-- Returns {Redis time ms, then per provider: live pins, live leases, then per flag: value or
-- false, its PTTL ms}. Counts are ZCOUNT over expiries/deadlines after now, as the scripts count.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = tonumber(ARGV[1])
local out = {now}
local live = '(' .. now
for i = 1, n do
  out[#out + 1] = redis.call('ZCOUNT', KEYS[2 * i - 1], live, '+inf')
  out[#out + 1] = redis.call('ZCOUNT', KEYS[2 * i], live, '+inf')
end
for i = 2 * n + 1, #KEYS do
  out[#out + 1] = redis.call('GET', KEYS[i])
  out[#out + 1] = redis.call('PTTL', KEYS[i])
end
return out
