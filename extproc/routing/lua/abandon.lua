-- Abandon a decision whose answer never reached its caller (the client hung up, the decision
-- timed out or failed), so whatever it may have admitted ends: the lease id becomes an expired
-- record on every provider of the model (a tombstone: an admission with that id still on its way
-- replays as LEASE_EXPIRED and never admits; housekeeping forgets it a lease timeout later), it
-- leaves the session's leases, and the session's pin ends if the decision made it (its id is the
-- one minted for the decision) and no other lease holds it. Idempotent.
-- Replies RELEASED when a live lease was found, LEASE_EXPIRED when only an expired one, else
-- NOT_FOUND (the id was never admitted), with the session's pin afterwards.
-- Op ARGV: lease id, the pin id minted for the decision. With the queue on, the ticket of the same id
-- leaves every queue and the freed slots wake their queues' heads.
local ctx = read_context()
local lease_id, pin_id = op_arg(ctx, 1), op_arg(ctx, 2)
local result = 'NOT_FOUND'
if ctx.queue then
  queue_drop_ticket(ctx, lease_id, false)  -- the decision's ticket, if it waited (its id is the lease id)
end
for _, p in pairs(ctx.by_name) do
  local score = tonumber(redis.call('ZSCORE', p.leases_key, lease_id))
  if score and score > ctx.now then
    result = 'RELEASED'
    if ctx.queue then
      queue_wake(ctx, p)  -- a slot is free: the queue's head may take it (lua/queue.lua)
    end
  elseif score and result == 'NOT_FOUND' then
    result = 'LEASE_EXPIRED'
  end
  redis.call('ZADD', p.leases_key, ctx.now, lease_id)
  extend_ttl(p.leases_key, ctx.lease_timeout + ctx.grace)
  forget_endpoint_lease(p, lease_id)
  forget_earlier(ctx, p, lease_id)
end
redis.call('ZREM', ctx.session_leases_key, lease_id)
local pin = read_pin(ctx)
if pin and ctx.by_name[pin.provider] then
  local p = ctx.by_name[pin.provider]
  if pin.id == pin_id then
    pin.deadline = ctx.now
  end
  pin.expiry = math.max(pin.deadline, latest_session_lease_deadline(ctx))
  if pin.expiry <= ctx.now then
    drop_pin(ctx, p, pin)
    pin = nil
  else
    save_pin(ctx, p, pin)
  end
end
return reply(ctx, result, pin, lease_id)
