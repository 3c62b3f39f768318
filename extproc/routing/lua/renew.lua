-- Renew a live request lease for another lease timeout. An expired lease is LEASE_LOST and is
-- never re-created (the caller cancels its request).
-- The pin's expiry follows only when the lease is one of the current pin's (lease_on_pin).
-- Op ARGV: provider name, lease id, pin id (unused: the server's records decide).
local ctx = read_context()
local p = ctx.by_name[op_arg(ctx, 1)]
local lease_id = op_arg(ctx, 2)
if not p then
  return unknown_provider(ctx, op_arg(ctx, 1))
end
local score = tonumber(redis.call('ZSCORE', p.leases_key, lease_id))
if not score or score <= ctx.now then
  return reply(ctx, 'LEASE_LOST', nil, lease_id)
end
local deadline = math.max(score, ctx.now + ctx.lease_timeout)
redis.call('ZADD', p.leases_key, 'XX', deadline, lease_id)
extend_ttl(p.leases_key, ctx.lease_timeout + ctx.grace)
local pin = read_pin(ctx)
if lease_on_pin(ctx, p, pin, lease_id) then
  redis.call('ZADD', ctx.session_leases_key, 'XX', deadline, lease_id)
  pin.expiry = math.max(pin.expiry, deadline)
  save_pin(ctx, p, pin)
else
  renew_earlier(ctx, p, lease_id, deadline)
  pin = nil
end
return reply(ctx, 'RENEWED', pin, lease_id, deadline)
