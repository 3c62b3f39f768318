-- ROUTING_STATE.try_admit_unpinned_session_request(provider, model, session): pin the session to
-- the provider and admit the request, unless another request pinned the session first.
-- Op ARGV: provider name, lease id, id for the new pin.
local ctx = read_context()
local p = ctx.by_name[op_arg(ctx, 1)]
local lease_id, pin_id = op_arg(ctx, 2), op_arg(ctx, 3)
if not p then
  return unknown_provider(ctx, op_arg(ctx, 1))
end
local replay = replayed_admission(ctx, p, lease_id)
if replay then
  return replay
end
local pin = read_pin(ctx)
if pin then
  return reply(ctx, 'ALREADY_PINNED', pin)
end
tidy_provider(ctx, p)
local result = capacity_result(ctx, p, 0, false, true)
if result ~= 'ADMITTED' then
  return reply(ctx, result, nil)
end
local lease_deadline
pin, lease_deadline = create_pin(ctx, p, pin_id, lease_id)
return reply(ctx, 'ADMITTED', pin, lease_id, lease_deadline)
