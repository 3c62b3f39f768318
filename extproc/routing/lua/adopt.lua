-- Adopt a request lease this process holds for a request that is already running: one granted
-- locally while Redis was unreachable, one Redis lost (a restart without persistence, a flush, a
-- failover), or one that expired while its renewals could not reach Redis. It is recorded
-- without a capacity check (its request runs either way) and counts from now on like any lease:
-- the deadline becomes max(recorded deadline, now + lease timeout), so a live lease is never
-- shortened and an expired record is brought back. It is a temporary lease: the session's
-- leases and pin are not touched.
-- On a pair with affinity pick, the lease counts on its endpoint again when the caller knows it.
-- Op ARGV: provider name, lease id, the lease's endpoint (`ip:port`, "" when none).
local ctx = read_context()
local p = ctx.by_name[op_arg(ctx, 1)]
local lease_id = op_arg(ctx, 2)
if not p then
  return unknown_provider(ctx, op_arg(ctx, 1))
end
local score = tonumber(redis.call('ZSCORE', p.leases_key, lease_id)) or 0
local deadline = math.max(score, ctx.now + ctx.lease_timeout)
redis.call('ZADD', p.leases_key, deadline, lease_id)
extend_ttl(p.leases_key, ctx.lease_timeout + ctx.grace)
local j = p.pick and p.pick.index[op_arg(ctx, 3) or '']
if j then
  redis.call('ZADD', p.pick.leases[j], deadline, lease_id)
  extend_ttl(p.pick.leases[j], ctx.lease_timeout + ctx.grace)
  ctx.endpoints = op_arg(ctx, 3)
end
return reply(ctx, 'ADMITTED', nil, lease_id, deadline)
