-- Adopt a request lease this process holds for a request that is already running: one granted
-- locally while Redis was unreachable, one Redis lost (a restart without persistence, a flush, a
-- failover), or one that expired in Redis. The deadline becomes max(recorded deadline, now +
-- lease timeout), so a live lease is never shortened and an expired record is brought back. It
-- is a temporary lease: the session's leases and pin are not touched (a later renewal extends the
-- session's record of it, when there is one).
-- Without a capacity check (its request runs either way) unless `within limits` is "1": then a
-- lease that is no longer live in Redis (expired, or gone under the same epoch) comes back only
-- through the capacity check of an admission on a pin (lib.lua's spec rules: the pair's global
-- in-flight limit, reserved slots included, and the session's own limit on the pair when KEYS
-- are its session's, counting its leases on the pair only, whichever provider its pin is on now; on a pair with affinity pick, its endpoint's cap too), and otherwise is
-- refused with that rule's answer: its slot went to another request since it expired (the lease
-- table then reports it lost). A live lease is extended either way. The admission queue's order
-- is not consulted: the request had its slot and still runs.
-- On a pair with affinity pick, the lease counts on its endpoint again when the caller knows it.
-- Op ARGV: provider name, lease id, within limits ("1"/"0"), the lease's endpoint (`ip:port`,
-- "" when none).
local ctx = read_context()
local p, unknown = op_provider(ctx)
if not p then
  return unknown
end
local lease_id = op_arg(ctx, 2)
local j = p.pick and p.pick.index[op_arg(ctx, 4) or '']
local score = tonumber(redis.call('ZSCORE', p.leases_key, lease_id)) or 0
if op_arg(ctx, 3) == '1' and score <= ctx.now then
  -- The session's limit on p counts its leases on p only: its current pin's when the pin is on p,
  -- and earlier pins' (earlier_in_flight); a pin moved to another provider takes its leases along.
  local pin = read_pin(ctx)
  local session_in_flight = (pin and pin.provider == p.name) and session_in_flight_on(ctx, p) or earlier_in_flight(ctx, p)
  local result = spec_capacity_result(ctx, p, session_in_flight, true, false)
  if result == 'ADMITTED' and j and p.pick.cap ~= NO_LIMIT and live_count(p.pick.leases[j], ctx.now) >= p.pick.cap then
    result = 'GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED'
  end
  if result ~= 'ADMITTED' then
    return reply(ctx, result, nil, lease_id)
  end
end
local deadline = math.max(score, ctx.now + ctx.lease_timeout)
redis.call('ZADD', p.leases_key, deadline, lease_id)
extend_ttl(p.leases_key, ctx.lease_timeout + ctx.grace)
if j then
  redis.call('ZADD', p.pick.leases[j], deadline, lease_id)
  extend_ttl(p.pick.leases[j], ctx.lease_timeout + ctx.grace)
  ctx.endpoints = op_arg(ctx, 4)
end
return reply(ctx, 'ADMITTED', nil, lease_id, deadline)
