-- Release request leases, refreshing the pin's inactivity deadline when asked (after a
-- successful response). Idempotent: a second release answers NOT_FOUND and changes nothing.
-- Releasing the last lease of a pin whose deadline has passed ends the pin at once.
-- Only a lease of the session's current pin (lease_on_pin) refreshes or ends the pin.
-- Op ARGV: per lease, provider name, lease id, pin id (unused: the server's records decide),
-- refresh ("1"/"0").
-- Several leases of the model (the lease table's releases of one loop turn) are released in one
-- call, each exactly as alone, in order: KEYS[1..3] are the first lease's session keys, and 3
-- more per further lease (its session's pin, leases, earlier leases) come after every other key.
-- Reply: one lease: lib.lua's reply (an error reply for an unknown provider); several: a list of
-- them, an unknown provider's as {'UNKNOWN_PROVIDER', now, ...}.

local function release_one(ctx, p, lease_id, refresh)
  local score = tonumber(redis.call('ZSCORE', p.leases_key, lease_id))
  if not score then
    return reply(ctx, 'NOT_FOUND', nil, lease_id)
  end
  redis.call('ZREM', p.leases_key, lease_id)
  forget_endpoint_lease(p, lease_id)
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
end

local ctx = read_context()
return each_lease(ctx, 4, function(p, i)
  return release_one(ctx, p, op_arg(ctx, i + 1), op_arg(ctx, i + 3) == '1')
end)
