-- ROUTING_STATE.try_admit_pinned_session_request(model, session): admit the request on the
-- session's current pin, which may use the slots reserved for pinned sessions.
-- Op ARGV: lease id.
local ctx = read_context()
local lease_id = op_arg(ctx, 1)
local pin = read_pin(ctx)
if not pin then
  return reply(ctx, 'SESSION_NOT_PINNED', nil)
end
local p = ctx.by_name[pin.provider]
if not p then
  -- Pinned to a provider this proxy does not route the model to: the caller repins.
  return reply(ctx, 'PROVIDER_NOT_CONFIGURED', pin)
end
local replay = replayed_admission(ctx, p, lease_id)
if replay then
  return replay
end
return admit_on_pin(ctx, p, pin, lease_id)
