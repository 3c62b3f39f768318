-- routing.third_party_share for a temporary request on a pair without limits, which takes no lease
-- (the spec): the identity's share is checked and the admission counted (share_admits), nothing
-- else. Replies ADMITTED or THIRD_PARTY_SHARE_REACHED, without pin or lease.
-- Op ARGV: provider name, the decision's lease id (the admission's member in the share's zsets).
local ctx = read_context()
local p, unknown = op_provider(ctx)
if not p then
  return unknown
end
if not share_admits(ctx, p, op_arg(ctx, 2)) then
  return reply(ctx, 'THIRD_PARTY_SHARE_REACHED', nil)
end
return reply(ctx, 'ADMITTED', nil)
