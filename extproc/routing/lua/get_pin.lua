-- ROUTING_STATE.get_pin(model, session): the session's live pin, if any. Writes nothing.
local ctx = read_context()
local pin = read_pin(ctx)
if pin then
  return reply(ctx, 'PINNED', pin)
end
return reply(ctx, 'NOT_PINNED', nil)
