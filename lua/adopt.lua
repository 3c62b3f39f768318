-- Adopt a request lease granted locally while Redis was unreachable (the `degrade` outage
-- policy): the request is already running, so it is recorded without a capacity check and
-- counts from now on like any lease. Never replaces an existing lease.
-- Op ARGV: provider name, lease id.
local ctx = read_context()
local p = ctx.by_name[op_arg(ctx, 1)]
local lease_id = op_arg(ctx, 2)
if not p then
  return unknown_provider(ctx, op_arg(ctx, 1))
end
local deadline = ctx.now + ctx.lease_timeout
redis.call('ZADD', p.leases_key, 'NX', deadline, lease_id)
redis.call('PEXPIRE', p.leases_key, ctx.lease_timeout + ctx.grace)
return reply(ctx, 'ADMITTED', nil, lease_id, deadline)
