-- Release a request lease, refreshing the pin's inactivity deadline when asked (after a
-- successful response). Idempotent: a second release answers NOT_FOUND and changes nothing.
-- Releasing the last lease of a pin whose deadline has passed ends the pin at once.
-- Only a lease of the session's current pin (lease_on_pin) refreshes or ends the pin.
-- Op ARGV: provider name, lease id, pin id (unused: the server's records decide), refresh ("1"/"0").
local ctx = read_context()
local p = ctx.by_name[op_arg(ctx, 1)]
local lease_id, refresh = op_arg(ctx, 2), op_arg(ctx, 4) == '1'
if not p then
  return unknown_provider(ctx, op_arg(ctx, 1))
end
local score = tonumber(redis.call('ZSCORE', p.leases_key, lease_id))
if not score then
  return reply(ctx, 'NOT_FOUND', nil, lease_id)
end
redis.call('ZREM', p.leases_key, lease_id)
forget_earlier(ctx, p, lease_id)
if ctx.queue and score > ctx.now then
  queue_wake(ctx, p)  -- a slot is free: the queue's head may take it (lua/queue.lua)
end
local pin = read_pin(ctx)
local on_pin = lease_on_pin(ctx, p, pin, lease_id)
if score <= ctx.now then
  if on_pin then
    redis.call('ZREM', ctx.session_leases_key, lease_id)
  end
  return reply(ctx, 'LEASE_EXPIRED', nil, lease_id)
end
if not on_pin then
  return reply(ctx, 'RELEASED', nil, lease_id)
end
redis.call('ZREM', ctx.session_leases_key, lease_id)
if refresh then
  pin.deadline = ctx.now + ctx.pin_timeout
end
pin.expiry = math.max(pin.deadline, latest_session_lease_deadline(ctx))
if pin.expiry <= ctx.now then
  drop_pin(ctx, p, pin)
  pin = nil
else
  save_pin(ctx, p, pin)
end
return reply(ctx, 'RELEASED', pin, lease_id)
