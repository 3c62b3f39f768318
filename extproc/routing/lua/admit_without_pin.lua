-- ROUTING_STATE.try_admit_request_without_pin(provider, model): a temporary request (no session,
-- or offloaded from its pin) takes a lease on a pair with limits; it may not use reserved slots.
-- Op ARGV: provider name, lease id.
local ctx = read_context()
local p, unknown = op_provider(ctx)
if not p then
  return unknown
end
local lease_id = op_arg(ctx, 2)
local replay = replayed_admission(ctx, p, lease_id)
if replay then
  return replay
end
tidy_provider(ctx, p)
ctx.lease_id = lease_id
local result = capacity_result(ctx, p, nil, false, false)
if result ~= 'ADMITTED' then
  return reply(ctx, result, nil)
end
if not share_admits(ctx, p, lease_id) then
  return reply(ctx, 'THIRD_PARTY_SHARE_REACHED', nil)
end
local deadline = add_lease(ctx, p, lease_id)
return reply(ctx, 'ADMITTED', nil, lease_id, deadline)
