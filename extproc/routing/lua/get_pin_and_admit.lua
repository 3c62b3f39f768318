-- The spec's first routing attempt fused into one round trip: get_pin, then, if the pin's
-- provider is among the eligible ones, try_admit_pinned_session_request; if there is no pin,
-- try_admit_unpinned_session_request on the first eligible provider. Atomic, so it behaves as
-- the spec's steps with nothing interleaved between them. Replies as the admission would, with
-- PINNED (pin, nothing attempted) or NOT_PINNED (no eligible provider) otherwise, then five more
-- elements: the branch ("pinned" or "unpinned"), and the pin's deadline, expiry, provider and id
-- as get_pin saw them, before the admission moved its expiry ("" without a pin). The pin is
-- repeated there because some admission answers carry none (a LEASE_EXPIRED replay).
-- Op ARGV: lease id, id for a new pin, then the eligible provider names in priority order.
local ctx = read_context()
local lease_id, pin_id = op_arg(ctx, 1), op_arg(ctx, 2)
local eligible = {}
for i = ctx.args_at + 2, #ARGV do
  eligible[ARGV[i]] = true
end
local pin = read_pin(ctx)
local answer
if pin then
  local seen_deadline, seen_expiry = pin.deadline, pin.expiry
  local p = ctx.by_name[pin.provider]
  if p and eligible[pin.provider] then
    answer = replayed_admission(ctx, p, lease_id) or admit_on_pin(ctx, p, pin, lease_id)
  else
    answer = reply(ctx, 'PINNED', pin)
  end
  table.insert(answer, 'pinned')
  table.insert(answer, seen_deadline)
  table.insert(answer, seen_expiry)
  table.insert(answer, pin.provider)
  table.insert(answer, pin.id)
  return answer
end
local first = ARGV[ctx.args_at + 2] and ctx.by_name[ARGV[ctx.args_at + 2]]
if first then
  answer = replayed_admission(ctx, first, lease_id) or admit_new_pin(ctx, first, lease_id, pin_id)
else
  answer = reply(ctx, 'NOT_PINNED', nil)
end
table.insert(answer, 'unpinned')
table.insert(answer, '')
table.insert(answer, '')
table.insert(answer, '')
table.insert(answer, '')
return answer
