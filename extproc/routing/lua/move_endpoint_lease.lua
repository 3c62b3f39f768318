-- Affinity pick: a request placed on one endpoint of a pair was answered by another (Envoy's
-- retry policy retried a refused connection on the pick's next endpoint): its lease leaves the
-- endpoint it was placed on and counts on the endpoint that answered, with the same deadline
-- (renewals move it there: renew_endpoint_lease is XX on every endpoint; a release or an
-- abandonment removes it from every one). Only a live lease recorded on `from` moves; idempotent
-- (a lease already moved, released or expired is left as it is). An endpoint the pair does not
-- list, a provider that does not pick, or `from` = `to`: nothing changes. A move also teaches
-- `to`'s prefix index the request's blocks (lib.lua's prompt blocks, as its admission passed
-- them): the session's next placement finds its prefix where it was served.
-- Op ARGV: provider name, lease id, the endpoint placed on, the endpoint that answered (`ip:port`).
-- Reply: lib.lua's reply: MOVED with the lease's deadline when it counts on `to` now (moved, or
-- moved before), else NOT_FOUND; an error reply for an unknown provider.
local ctx = read_context()
local p, unknown = op_provider(ctx)
if not p then
  return unknown
end
local lease_id = op_arg(ctx, 2)
local from = p.pick and p.pick.index[op_arg(ctx, 3)]
local to = p.pick and p.pick.index[op_arg(ctx, 4)]
if not from or not to or from == to then
  return reply(ctx, 'NOT_FOUND', nil, lease_id)
end
local score = tonumber(redis.call('ZSCORE', p.pick.leases[from], lease_id))
if not score or score <= ctx.now then
  local moved = tonumber(redis.call('ZSCORE', p.pick.leases[to], lease_id))
  if moved and moved > ctx.now and not score then
    return reply(ctx, 'MOVED', nil, lease_id, moved)
  end
  return reply(ctx, 'NOT_FOUND', nil, lease_id)
end
redis.call('ZREM', p.pick.leases[from], lease_id)
redis.call('ZADD', p.pick.leases[to], score, lease_id)
extend_ttl(p.pick.leases[to], ctx.lease_timeout + ctx.grace)
drop_expired(p.pick.leases[to], ctx.now - ctx.lease_timeout)
learn_blocks(ctx, p.pick, to)
return reply(ctx, 'MOVED', nil, lease_id, score)
