-- ROUTING_STATE.try_admit_unpinned_session_request(provider, model, session): pin the session to
-- the provider and admit the request, unless another request pinned the session first.
-- Op ARGV: provider name, lease id, id for the new pin.
local ctx = read_context()
local p, unknown = op_provider(ctx)
if not p then
  return unknown
end
local lease_id, pin_id = op_arg(ctx, 2), op_arg(ctx, 3)
local replay = replayed_admission(ctx, p, lease_id)
if replay then
  return replay
end
local pin = read_pin(ctx)
if pin then
  return reply(ctx, 'ALREADY_PINNED', pin)
end
return admit_new_pin(ctx, p, lease_id, pin_id)
