-- Passive health: record one upstream failure of a (provider, model) pair and, when the sliding
-- window holds enough of them, mark the pair degraded for a cool-down. The window counts the
-- failures seen by every proxy instance.
-- KEYS: [1] the pair's recent failures (zset: failure id -> Redis time, ms)
--       [2] the pair's passive degraded flag (string with a TTL)
-- ARGV: [1] failure id, [2] window ms, [3] failures that degrade, [4] cool-down ms, [5] reason
-- Returns {1 when this failure degraded the pair else 0, failures in the window}.
local now = redis_now_ms()
local window = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local count = redis.call('ZCARD', KEYS[1])
if count >= tonumber(ARGV[3]) then
  redis.call('SET', KEYS[2], ARGV[5], 'PX', ARGV[4])
  redis.call('DEL', KEYS[1])
  return {1, count}
end
redis.call('PEXPIRE', KEYS[1], window)
return {0, count}
