-- A decision that waited for an own slot and ends without one (it went on to the third party or
-- was rejected) removes its ticket from every queue of the model (lua/queue.lua). Idempotent.
-- Replies RELEASED when the ticket was there, NOT_FOUND otherwise. No op ARGV: the ticket id is the
-- queue section's.
local ctx = read_context()
if ctx.queue and ctx.queue.ticket ~= '' and queue_drop_ticket(ctx, ctx.queue.ticket, false) then
  return reply(ctx, 'RELEASED', nil)
end
return reply(ctx, 'NOT_FOUND', nil)
