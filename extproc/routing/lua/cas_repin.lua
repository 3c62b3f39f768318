-- ROUTING_STATE.try_compare_and_swap_pin_and_admit_request(expected_pin, model, session,
-- provider): move the session's pin to the provider and admit the request there, only if the
-- pin is still the expected one. A repin creates a new pin, so it may not use reserved slots.
-- Replies PIN_MISMATCH (with the current pin) when the pin changed or expired.
-- Op ARGV: expected pin id, target provider name, lease id, id for the new pin.
-- KEYS ends with one more key: the pins key of the expected pin's provider.
local ctx = read_context()
local expected_pin_id = op_arg(ctx, 1)
local target = ctx.by_name[op_arg(ctx, 2)]
local lease_id, new_pin_id = op_arg(ctx, 3), op_arg(ctx, 4)
if not target then
  return unknown_provider(ctx, op_arg(ctx, 2))
end
local replay = replayed_admission(ctx, target, lease_id)
if replay then
  return replay
end
local pin = read_pin(ctx)
if not pin or pin.id ~= expected_pin_id then
  return reply(ctx, 'PIN_MISMATCH', pin)
end
if pin.provider == target.name then
  return reply(ctx, 'ALREADY_PINNED', pin)
end
tidy_provider(ctx, target)
ctx.lease_id = lease_id
local result = capacity_result(ctx, target, earlier_in_flight(ctx, target), false, true)
if result ~= 'ADMITTED' then
  return reply(ctx, result, pin)
end
if not share_admits(ctx, target, lease_id) then
  return reply(ctx, 'THIRD_PARTY_SHARE_REACHED', pin)
end
-- The old pin stops counting on its provider at once, even when this proxy's configuration no
-- longer routes the model there (a rollout): that provider's pins key then comes last in KEYS.
local old = ctx.by_name[pin.provider] or {pins_key = KEYS[#KEYS]}
retire_session_leases(ctx, pin)
drop_pin(ctx, old, pin)
local new_pin, lease_deadline = create_pin(ctx, target, new_pin_id, lease_id)
return reply(ctx, 'ADMITTED', new_pin, lease_id, lease_deadline)
