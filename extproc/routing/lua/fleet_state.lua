-- Read-only: the fleet state of one model, for the metrics collector and `iris-extproc status`
-- (extproc/fleet_state.py). Not a routing transition: it writes nothing and needs no lib.lua.
-- KEYS: [2i-1] provider i's live pins of this model (zset: pin id -> pin expiry, ms)
--       [2i]   provider i's leases of this model (zset: lease id -> lease deadline, ms)
--       then the degraded flags to read (strings with a TTL)
--       then, when the admission queue is on for the model (docs/queue.md), the model's tickets
--       (zset: ticket id -> deadline, ms) and provider i's queue (zset: ticket id -> score)
-- ARGV: [1] n providers (the number of pins/leases key pairs), [2] the number of flag keys
--       (default: every key after the pairs), [3] the number of priority classes (0: queue off)
-- Returns {Redis time ms, then per provider: live pins, live leases, then per flag: value or
-- false, its PTTL ms, then per provider and class: live tickets}. Counts are ZCOUNT over
-- expiries/deadlines after now, as the scripts count; a ticket counts while its lease is live.
local CLASS_SPAN = 1125899906842624  -- 2^50, as lua/queue.lua scores tickets
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = tonumber(ARGV[1])
local flags = tonumber(ARGV[2]) or (#KEYS - 2 * n)
local classes = tonumber(ARGV[3]) or 0
local out = {now}
local live = '(' .. now
for i = 1, n do
  out[#out + 1] = redis.call('ZCOUNT', KEYS[2 * i - 1], live, '+inf')
  out[#out + 1] = redis.call('ZCOUNT', KEYS[2 * i], live, '+inf')
end
for i = 2 * n + 1, 2 * n + flags do
  out[#out + 1] = redis.call('GET', KEYS[i])
  out[#out + 1] = redis.call('PTTL', KEYS[i])
end
if classes > 0 then
  local tickets = KEYS[2 * n + flags + 1]
  for i = 1, n do
    local counts = {}
    for c = 1, classes do
      counts[c] = 0
    end
    local members = redis.call('ZRANGE', KEYS[2 * n + flags + 1 + i], 0, -1, 'WITHSCORES')
    for j = 1, #members, 2 do
      local deadline = tonumber(redis.call('ZSCORE', tickets, members[j]))
      local class = math.floor(tonumber(members[j + 1]) / CLASS_SPAN) + 1
      if deadline and deadline > now and counts[class] then
        counts[class] = counts[class] + 1
      end
    end
    for c = 1, classes do
      out[#out + 1] = counts[c]
    end
  end
end
return out
