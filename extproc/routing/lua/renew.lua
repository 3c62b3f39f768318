-- Renew live request leases for another lease timeout. An expired lease is LEASE_LOST and is
-- never re-created (the caller cancels its request).
-- The pin's expiry follows only when the lease is one of the current pin's (lease_on_pin).
-- Op ARGV: per lease, provider name, lease id, pin id (unused: the server's records decide).
-- Several leases of the model (the lease table's renewal sweep) are renewed in one call, each
-- exactly as alone, in order: KEYS[1..3] are the first lease's session keys, and 3 more per
-- further lease (its session's pin, leases, earlier leases) come after every other key.
-- Reply: one lease: lib.lua's reply (an error reply for an unknown provider); several: a list of
-- them, an unknown provider's as {'UNKNOWN_PROVIDER', now, ...}.

local function renew_one(ctx, p, lease_id)
  local score = tonumber(redis.call('ZSCORE', p.leases_key, lease_id))
  if not score or score <= ctx.now then
    return reply(ctx, 'LEASE_LOST', nil, lease_id)
  end
  local deadline = math.max(score, ctx.now + ctx.lease_timeout)
  redis.call('ZADD', p.leases_key, 'XX', deadline, lease_id)
  extend_ttl(p.leases_key, ctx.lease_timeout + ctx.grace)
  renew_endpoint_lease(ctx, p, lease_id, deadline)
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
end

local ctx = read_context()
return each_lease(ctx, 3, function(p, i)
  return renew_one(ctx, p, op_arg(ctx, i + 1))
end)
