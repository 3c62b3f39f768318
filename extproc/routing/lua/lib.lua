-- Shared by every routing script (prepended to each one when it is loaded).
-- The routing state of one model lives under one hash tag, so a Redis Cluster keeps it in one slot.
--
-- KEYS: [1] the session's pin (hash: provider, id, deadline, expiry)
--       [2] the session's leases on its current pin (zset: lease id -> lease deadline, ms)
--       [3] the session's leases on its earlier pins, still running after a compare-and-swap
--           moved the pin (zset: "<provider>/<lease id>" -> lease deadline, ms)
--       [2+2i] provider i's live pins of this model (zset: pin id -> pin expiry, ms)
--       [3+2i] provider i's leases of this model (zset: lease id -> lease deadline, ms)
--       then, with routing.third_party_share on, the identity's two share zsets (read_share);
--       a script's own extra keys come last.
-- ARGV: [1] now in ms, or "" to take Redis TIME (tests pass an explicit time, production never)
--       [2] pin inactivity timeout ms, [3] lease timeout ms, [4] housekeeping grace ms for key TTLs
--       [5] n providers, then 5 per provider: name, max pinned sessions, max global in-flight
--       request slots, slots reserved for pinned sessions, max per-session in-flight slots
--       (-1: no limit); then 4 for routing.third_party_share (read_share); then the admission
--       queue's section (lua/queue.lua: "0" when the queue is off for the call); then the epoch
--       flag ("1": the reply ends with the routing state's epoch, `with_epoch`; "0": it does not);
--       then the operation's own arguments.
--       With the queue on, KEYS go on after the providers' keys (and the share's two) with the
--       queue's (lua/queue.lua); with the epoch flag "1", the epoch key `{prefix}:epoch` comes
--       next (only where Redis has no hash slots: standalone or Sentinel), before the script's own.
--       After the epoch flag, the section of affinity `pick` (read_pick): ARGV and KEYS of the
--       pairs whose endpoint the router picks, then the request's prompt blocks; KEYS after the
--       epoch key.
--
-- A pin is live while its expiry is in the future; expiry = max(inactivity deadline, deadline of
-- every lease on the pin), so a live lease keeps its pin alive and counts never include the dead.
-- Every check comes before every write: scripts do not roll back.
-- The per-session limit counts every live lease of the session on the pair, whichever of its
-- pins it was admitted on (issue 10, item 8): a session repinned away and back while its
-- requests run there never has more than max_per_session in flight on one pair.

local NO_LIMIT = -1
local CLEANUP_BATCH = 64

-- The epoch key when the call's epoch flag asks for the epoch (read_context), else nil.
local epoch_key = nil

-- The admission queue (lua/queue.lua, appended after this file; docs/queue.md).
local queue_section, queue_gate, queue_wake, queue_drop_ticket

local function redis_now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- routing.third_party_share (docs/operations.md "Third-party spend"), off when its window is 0.
-- ARGV after the providers' limits: window ms, max share in millionths, burst, the unlimited
-- providers' names joined by ','. When on, KEYS holds two more after the providers' keys: the
-- identity's admissions in the window and those on unlimited providers (zsets: lease id -> ms).
local function read_share(n)
  local at = 6 + n * 5
  local window = tonumber(ARGV[at]) or 0
  if window <= 0 then
    return nil
  end
  local share = {window = window, max_ppm = tonumber(ARGV[at + 1]), burst = tonumber(ARGV[at + 2]),
    all_key = KEYS[4 + 2 * n], unlimited_key = KEYS[5 + 2 * n], unlimited = {}}
  for name in string.gmatch(ARGV[at + 3], '[^,]+') do
    share.unlimited[name] = true
  end
  return share
end

-- Affinity `pick` (docs/routing-state.md "Endpoint placement"): the pairs of the model whose
-- endpoint the router picks. ARGV from `at`: m, the number of such pairs, then per pair: provider
-- name, max in flight per endpoint (-1: no cap), E, then the E endpoints (`ip:port`); when m > 0,
-- the placement's prefix weight, load weight, index size per endpoint and index TTL ms; then the
-- request's prompt blocks: k, then k chained block hashes (k = 0: none, or a call that places
-- nothing); when m > 0, then the provider name and endpoint that store the previous response of
-- a Responses turn ("", "": none). KEYS from `keys_at`: per pair, its E endpoints' lease zsets
-- (lease id -> deadline ms) then their E prefix indexes (block hash -> last served ms), then the
-- pair's endpoint health flags (endpoint_down). Sets p.pick on each pair and ctx.placement,
-- ctx.blocks, ctx.chained (nil: none); returns the
-- position of the first op argument.
local function read_pick(ctx, at, keys_at)
  local m = tonumber(ARGV[at])
  at = at + 1
  for _ = 1, m do
    local e = tonumber(ARGV[at + 2])
    local pick = {cap = tonumber(ARGV[at + 1]), endpoints = {}, index = {}, leases = {}, prefixes = {},
      health = KEYS[keys_at + 2 * e]}
    for j = 1, e do
      pick.endpoints[j] = ARGV[at + 2 + j]
      pick.index[ARGV[at + 2 + j]] = j
      pick.leases[j] = KEYS[keys_at + j - 1]
      pick.prefixes[j] = KEYS[keys_at + e + j - 1]
    end
    local p = ctx.by_name[ARGV[at]]
    if p then
      p.pick = pick
    end
    at = at + 3 + e
    keys_at = keys_at + 2 * e + 1
  end
  if m > 0 then
    ctx.placement = {prefix_weight = tonumber(ARGV[at]), load_weight = tonumber(ARGV[at + 1]),
      index_size = tonumber(ARGV[at + 2]), index_ttl = tonumber(ARGV[at + 3])}
    at = at + 4
  end
  local k = tonumber(ARGV[at])
  ctx.blocks = {}
  for i = 1, k do
    ctx.blocks[i] = ARGV[at + i]
  end
  at = at + 1 + k
  if m > 0 then
    if ARGV[at] ~= '' then
      ctx.chained = {provider = ARGV[at], endpoint = ARGV[at + 1]}
    end
    at = at + 2
  end
  return at
end

local function read_context()
  local ctx = {
    now = tonumber(ARGV[1]) or redis_now_ms(),
    pin_timeout = tonumber(ARGV[2]),
    lease_timeout = tonumber(ARGV[3]),
    grace = tonumber(ARGV[4]),
    pin_key = KEYS[1],
    session_leases_key = KEYS[2],
    session_earlier_key = KEYS[3],
    by_name = {},
  }
  local n = tonumber(ARGV[5])
  for i = 1, n do
    local at = 5 + (i - 1) * 5
    ctx.by_name[ARGV[at + 1]] = {
      name = ARGV[at + 1],
      max_pins = tonumber(ARGV[at + 2]),
      max_global = tonumber(ARGV[at + 3]),
      reserved = tonumber(ARGV[at + 4]),
      max_per_session = tonumber(ARGV[at + 5]),
      pins_key = KEYS[2 + 2 * i],
      leases_key = KEYS[3 + 2 * i],
    }
  end
  ctx.share = read_share(n)
  local keys_at = 4 + 2 * n + (ctx.share and 2 or 0)
  ctx.args_at = queue_section(ctx, 10 + n * 5, n, keys_at)
  keys_at = keys_at + (ctx.queue and 3 + 2 * n or 0)
  if ARGV[ctx.args_at] == '1' then
    epoch_key = KEYS[keys_at]
    keys_at = keys_at + 1
  end
  ctx.args_at = read_pick(ctx, ctx.args_at + 1, keys_at)
  return ctx
end

-- The script's answer, with the routing state's epoch ("" when there is none: Redis lost its
-- state) appended when the call asked for it: read in the same atomic script as the admission,
-- so the lease table needs no read of its own when it is the epoch it knows. An error reply is
-- left as it is. Every routing script returns through it (RoutingState's script_source).
local function with_epoch(answer)
  if epoch_key and type(answer) == 'table' and answer.err == nil then
    table.insert(answer, redis.call('GET', epoch_key) or '')
  end
  return answer
end

local function op_arg(ctx, i)
  return ARGV[ctx.args_at + i - 1]
end

local function live_count(key, now)
  return redis.call('ZCOUNT', key, '(' .. now, '+inf')
end

-- Memory housekeeping only: counts never include expired members anyway.
local function drop_expired(key, cutoff)
  local n = redis.call('ZCOUNT', key, '-inf', cutoff)
  if n > 0 then
    redis.call('ZREMRANGEBYRANK', key, 0, math.min(n, CLEANUP_BATCH) - 1)
  end
end

local function tidy_provider(ctx, p)
  drop_expired(p.leases_key, ctx.now - ctx.lease_timeout)
  drop_expired(p.pins_key, ctx.now)
end

-- A pin records its endpoint (`endpoint`, an `ip:port`) on a pair with affinity pick; the field
-- is read and written only there (a stale one on another pair is never read: a new pin on a pick
-- pair is always placed, admit_lease).
local function read_pin(ctx)
  local f = redis.call('HMGET', ctx.pin_key, 'provider', 'id', 'deadline', 'expiry', 'endpoint')
  if not f[1] then
    return nil
  end
  local pin = {provider = f[1], id = f[2], deadline = tonumber(f[3]), expiry = tonumber(f[4]), endpoint = f[5] or nil}
  if pin.expiry <= ctx.now then
    return nil
  end
  return pin
end

-- A key shared by many pins or leases keeps the longest TTL asked of it: a reload that shortens the
-- pin or lease timeout must not let it expire under the pins and leases made before.
local function extend_ttl(key, ms)
  if redis.call('PTTL', key) < ms then
    redis.call('PEXPIRE', key, ms)
  end
end

local function save_pin(ctx, p, pin)
  local ttl = pin.expiry - ctx.now + ctx.grace
  if pin.endpoint and p.pick then
    redis.call('HSET', ctx.pin_key, 'provider', pin.provider, 'id', pin.id,
      'deadline', pin.deadline, 'expiry', pin.expiry, 'endpoint', pin.endpoint)
  else
    redis.call('HSET', ctx.pin_key, 'provider', pin.provider, 'id', pin.id,
      'deadline', pin.deadline, 'expiry', pin.expiry)
  end
  redis.call('PEXPIRE', ctx.pin_key, ttl)
  redis.call('PEXPIRE', ctx.session_leases_key, ttl)  -- a no-op while the session holds no lease
  redis.call('ZADD', p.pins_key, pin.expiry, pin.id)
  extend_ttl(p.pins_key, math.max(ctx.pin_timeout, ctx.lease_timeout) + ctx.grace)
end

local function drop_pin(ctx, p, pin)
  redis.call('DEL', ctx.pin_key, ctx.session_leases_key)
  if p then
    redis.call('ZREM', p.pins_key, pin.id)
  end
end

-- Whether the lease is one of the session's current pin's: the pin is live, on the lease's
-- provider, and the session's leases record it. Decided from the server's records, never from the
-- caller's pin id: a repeated admission answers with the current pin, whichever pin the lease is
-- on, and a lease id may be reused on another provider.
local function lease_on_pin(ctx, p, pin, lease_id)
  return pin ~= nil and pin.provider == p.name
    and redis.call('ZSCORE', ctx.session_leases_key, lease_id) ~= false
end

local function earlier_member(p, lease_id)
  return p.name .. '/' .. lease_id
end

-- The session's live leases on pair p from its earlier pins. O(the session's earlier leases).
local function earlier_in_flight(ctx, p)
  local prefix = p.name .. '/'
  local n = 0
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', ctx.session_earlier_key, '(' .. ctx.now, '+inf')) do
    if string.sub(member, 1, #prefix) == prefix then
      n = n + 1
    end
  end
  return n
end

-- The session's live leases on pair p, counted against its per-session limit there: those of its
-- pin and those of its earlier pins (a session repinned away and back while its requests run).
local function session_in_flight_on(ctx, p)
  return live_count(ctx.session_leases_key, ctx.now) + earlier_in_flight(ctx, p)
end

-- A compare-and-swap moves the pin away: the old pin's live leases keep counting against the
-- session's per-session limit on their pair, as earlier leases.
local function retire_session_leases(ctx, pin)
  local live = redis.call('ZRANGEBYSCORE', ctx.session_leases_key, '(' .. ctx.now, '+inf', 'WITHSCORES')
  local latest = 0
  for i = 1, #live, 2 do
    redis.call('ZADD', ctx.session_earlier_key, live[i + 1], pin.provider .. '/' .. live[i])
    latest = math.max(latest, tonumber(live[i + 1]))
  end
  redis.call('ZREMRANGEBYSCORE', ctx.session_earlier_key, '-inf', ctx.now)
  if latest > 0 then
    redis.call('PEXPIRE', ctx.session_earlier_key, ctx.lease_timeout + ctx.grace)
  end
end

-- A renewal or a release of a lease that is not the current pin's: its earlier-lease record follows.
local function renew_earlier(ctx, p, lease_id, deadline)
  if redis.call('ZADD', ctx.session_earlier_key, 'XX', 'CH', deadline, earlier_member(p, lease_id)) > 0 then
    redis.call('PEXPIRE', ctx.session_earlier_key, ctx.lease_timeout + ctx.grace)
  end
end

local function forget_earlier(ctx, p, lease_id)
  redis.call('ZREM', ctx.session_earlier_key, earlier_member(p, lease_id))
end

local function latest_session_lease_deadline(ctx)
  local top = redis.call('ZRANGE', ctx.session_leases_key, -1, -1, 'WITHSCORES')
  return tonumber(top[2]) or 0
end

-- Placement on a pick pair (docs/routing-state.md "Endpoint placement").

-- How many of the request's leading prompt blocks endpoint j of `pick` served recently: the
-- blocks' hashes are chained (block i's hash covers blocks 1..i), so the index holding block i
-- means it held the blocks before it, and a binary search finds the longest run: O(log k) reads.
local function prefix_overlap(ctx, pick, j)
  local lo, hi = 0, #ctx.blocks
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if redis.call('ZSCORE', pick.prefixes[j], ctx.blocks[mid]) then
      lo = mid
    else
      hi = mid - 1
    end
  end
  return lo
end

-- The endpoints of pick pair p that some health flag takes out of placement now (a set:
-- `ip:port` -> true), and their engines' latest readings (`ip:port` -> requests the engine
-- holds). The pair's flags are one hash (extproc.routing.endpoint_health): field
-- "<ip:port> <source>", value "<until ms> <reason>", and field "<ip:port> reading", value
-- "<until ms> <requests>"; a field holds while its until is in the future (the writers drop the
-- expired ones). O(fields of the pair): none on a healthy pair without a load gauge.
local function endpoint_down(ctx, p)
  local down, engine = {}, {}
  local fields = redis.call('HGETALL', p.pick.health)
  for i = 1, #fields, 2 do
    local until_ms, value = string.match(fields[i + 1], '^(%d+) ?(.*)$')
    if until_ms and tonumber(until_ms) > ctx.now then
      local endpoint, kind = string.match(fields[i], '^(%S+) (%S+)$')
      if kind == 'reading' then
        engine[endpoint] = tonumber(value)
      elseif endpoint then
        down[endpoint] = true
      end
    end
  end
  return down, engine
end

-- Pair p's healthy endpoints under their cap, best first (a list of endpoint indexes; empty when
-- every endpoint is out or at its cap). An endpoint a health flag holds (endpoint_down) is never
-- ranked: a session pinned there is placed again, as a new one (its pin's endpoint changes at
-- its admission); sessions on the other endpoints keep theirs. `sticky` (an index or nil): the
-- session's pinned endpoint, first while under its cap; the fallbacks after it are then ranked by load alone (the common path of a
-- pinned turn reads no prefix index). Otherwise by placement score (prefix weight x overlap
-- share - load weight x load), then lower load, then a rotation by the lease id, so that equal
-- endpoints share new work instead of the first one taking it all. An endpoint's load is its
-- exact in-flight count, or its engine's latest reading (requests its engine holds, from the
-- same hash as the flags) when that is higher: the engine also sees work the router did not
-- send. The cap counts the exact in-flight count alone.
local function rank_endpoints(ctx, p, sticky, lease_id)
  local pick, placement = p.pick, ctx.placement
  local k = #ctx.blocks
  if sticky and (pick.cap == NO_LIMIT or live_count(pick.leases[sticky], ctx.now) < pick.cap) then
    k = 0
  end
  local down, engine = endpoint_down(ctx, p)
  if sticky and down[pick.endpoints[sticky]] then
    sticky, k = nil, #ctx.blocks  -- its endpoint is out: the session is placed again
  end
  local rotate = tonumber(string.sub(lease_id or '', 1, 6), 16) or 0
  local e = #pick.endpoints
  local ranked = {}
  for j = 1, e do
    local n = live_count(pick.leases[j], ctx.now)
    if not down[pick.endpoints[j]] and (pick.cap == NO_LIMIT or n < pick.cap) then
      local overlap = 0
      if k > 0 and placement.prefix_weight > 0 then
        overlap = prefix_overlap(ctx, pick, j) / k
      end
      local load = math.max(n, engine[pick.endpoints[j]] or 0)
      table.insert(ranked, {j = j, n = load, turn = (j + rotate) % e,
        first = (j == sticky) and 1 or 0, score = placement.prefix_weight * overlap - placement.load_weight * load})
    end
  end
  table.sort(ranked, function(a, b)
    if a.first ~= b.first then return a.first > b.first end
    if a.score ~= b.score then return a.score > b.score end
    if a.n ~= b.n then return a.n < b.n end
    return a.turn < b.turn
  end)
  local order = {}
  for i, r in ipairs(ranked) do
    order[i] = r.j
  end
  return order
end

-- The placement of an admission on pick pair p, kept in ctx.placed for admit_lease: the spec's
-- capacity rules passed, and some endpoint is under its cap (false: every one is at its cap).
--
-- A Responses turn continuing a response stored on an endpoint of p (ctx.chained) goes to that
-- endpoint alone, before the session's pin and placement, and even at its cap: the pair's own
-- limits passed, and no other replica holds the response (another one answers 404), so the cap,
-- which steers placement among replicas that could all serve, yields to it. The turn counts
-- there, so the next placements see the endpoint as loaded. An endpoint the pair no longer
-- lists, or one a health flag holds out (endpoint_down: it would fail the turn), is placed as
-- usual (its response is out of reach with it).
local function place(ctx, p, lease_id)
  local chained = ctx.chained
  local storing = chained and chained.provider == p.name and p.pick.index[chained.endpoint]
  if storing and not endpoint_down(ctx, p)[chained.endpoint] then
    ctx.placed = {storing}
    return true
  end
  local order = rank_endpoints(ctx, p, ctx.sticky and p.pick.index[ctx.sticky], lease_id)
  if #order == 0 then
    return false
  end
  ctx.placed = order
  return true
end

-- Endpoint j's prefix index learns the request's blocks (ctx.blocks; LRU: scored by time,
-- trimmed to the index size).
local function learn_blocks(ctx, pick, j)
  local k = #ctx.blocks
  local index = pick.prefixes[j]
  -- Already known and touched within the last sixteenth of the index TTL: nothing to learn (a
  -- session's later turns repeat its prefix), one read instead of a write of k members.
  local seen = k > 0 and redis.call('ZSCORE', index, ctx.blocks[k])
  if seen and tonumber(seen) > ctx.now - ctx.placement.index_ttl / 16 then
    k = 0
  end
  if k > 0 then
    local members = {}
    for i = 1, k do
      members[2 * i - 1] = ctx.now
      members[2 * i] = ctx.blocks[i]
    end
    redis.call('ZADD', index, unpack(members))
    local over = redis.call('ZCARD', index) - ctx.placement.index_size
    if over > 0 then
      redis.call('ZREMRANGEBYRANK', index, 0, over - 1)
    end
    redis.call('PEXPIRE', index, ctx.placement.index_ttl)
  end
end

-- The admitted lease joins its endpoint's leases (the endpoint's count), and the endpoint's
-- prefix index learns the request's blocks. Sets ctx.endpoints (the answer's `ip:port` list,
-- chosen first, then the next best). Returns the chosen endpoint.
local function record_placement(ctx, p, lease_id, deadline)
  local pick = p.pick
  local j = ctx.placed[1]
  redis.call('ZADD', pick.leases[j], deadline, lease_id)
  extend_ttl(pick.leases[j], ctx.lease_timeout + ctx.grace)
  drop_expired(pick.leases[j], ctx.now - ctx.lease_timeout)
  learn_blocks(ctx, pick, j)
  local names = {}
  for i, o in ipairs(ctx.placed) do
    names[i] = pick.endpoints[o]
  end
  ctx.endpoints = table.concat(names, ',')
  return pick.endpoints[j]
end

-- A lease of pick pair p leaves its endpoint's count (release, abandon): it is in at most one
-- endpoint's leases, and removing it from the others changes nothing, so no record of which is
-- needed. O(E log n).
local function forget_endpoint_lease(p, lease_id)
  if p.pick then
    for _, key in ipairs(p.pick.leases) do
      redis.call('ZREM', key, lease_id)
    end
  end
end

-- A renewal moves the lease's deadline on its endpoint too (XX: only where it is).
local function renew_endpoint_lease(ctx, p, lease_id, deadline)
  if p.pick then
    for _, key in ipairs(p.pick.leases) do
      if redis.call('ZADD', key, 'XX', 'CH', deadline, lease_id) > 0 then
        extend_ttl(key, ctx.lease_timeout + ctx.grace)
      end
    end
  end
end

-- The endpoint a recorded lease of pick pair p runs on, or nil.
local function lease_endpoint(p, lease_id)
  if p.pick then
    for j, key in ipairs(p.pick.leases) do
      if redis.call('ZSCORE', key, lease_id) then
        return p.pick.endpoints[j]
      end
    end
  end
  return nil
end

-- Returns the lease's deadline and, on a pick pair, the endpoint placement chose.
local function add_lease(ctx, p, lease_id)
  local deadline = ctx.now + ctx.lease_timeout
  redis.call('ZADD', p.leases_key, deadline, lease_id)
  extend_ttl(p.leases_key, ctx.lease_timeout + ctx.grace)
  if p.pick and ctx.placed then
    return deadline, record_placement(ctx, p, lease_id, deadline)
  end
  return deadline, nil
end

local function add_pinned_lease(ctx, p, pin, lease_id)
  local deadline, endpoint = add_lease(ctx, p, lease_id)
  if endpoint then
    pin.endpoint = endpoint
  end
  redis.call('ZADD', ctx.session_leases_key, deadline, lease_id)
  pin.expiry = math.max(pin.expiry, deadline)
  save_pin(ctx, p, pin)
  return deadline
end

local function create_pin(ctx, p, pin_id, lease_id)
  redis.call('DEL', ctx.session_leases_key)
  local deadline = ctx.now + ctx.pin_timeout
  local pin = {provider = p.name, id = pin_id, deadline = deadline, expiry = deadline}
  local lease_deadline = add_pinned_lease(ctx, p, pin, lease_id)
  return pin, lease_deadline
end

-- The spec's capacity rules for one provider/model pair. session_in_flight is nil for requests
-- without a session; only existing pinned sessions may use the reserved slots.
local function spec_capacity_result(ctx, p, session_in_flight, may_use_reserved, needs_new_pin)
  if needs_new_pin and p.max_pins ~= NO_LIMIT and live_count(p.pins_key, ctx.now) >= p.max_pins then
    return 'PIN_LIMIT_REACHED'
  end
  if session_in_flight and p.max_per_session ~= NO_LIMIT and session_in_flight >= p.max_per_session then
    return 'PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED'
  end
  if p.max_global ~= NO_LIMIT then
    local in_flight = live_count(p.leases_key, ctx.now)
    if in_flight >= p.max_global then
      return 'GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED'
    end
    if not may_use_reserved and in_flight >= p.max_global - p.reserved then
      return 'UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED'
    end
  end
  -- Affinity pick: inside the pair's limits, some endpoint must be under its cap; a pair whose
  -- every endpoint is at its cap is as full as at its global limit.
  if p.pick and not place(ctx, p, ctx.lease_id) then
    return 'GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED'
  end
  return 'ADMITTED'
end

-- The capacity check every admission makes: the spec's rules, then, when the admission queue is on
-- for the call, its gate (lua/queue.lua): a request of a class that may not use the reserved
-- slots finds a pin full where only those are left, and nobody takes a slot ahead of the waiters.
local function capacity_result(ctx, p, session_in_flight, may_use_reserved, needs_new_pin)
  if not ctx.queue then
    return spec_capacity_result(ctx, p, session_in_flight, may_use_reserved, needs_new_pin)
  end
  local reserved = may_use_reserved and ctx.queue.may_reserve
  local result = spec_capacity_result(ctx, p, session_in_flight, reserved, needs_new_pin)
  if may_use_reserved and not reserved and result == 'UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED' then
    result = 'GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED'
  end
  return queue_gate(ctx, p, result, reserved, may_use_reserved)
end

-- Reply: {result, now, pin provider, pin id, pin deadline, pin expiry, lease id, lease deadline};
-- "" where there is no pin or no lease.
-- A ninth element: the endpoints of an admission on a pick pair (`ip:port,...`, the chosen one
-- first, then the next best: the endpoint-picker protocol's fallbacks), else "".
local function reply(ctx, result, pin, lease_id, lease_deadline)
  local endpoints = ''
  if result == 'ADMITTED' then
    endpoints = ctx.endpoints or ''
  end
  if pin then
    return {result, ctx.now, pin.provider, pin.id, pin.deadline, pin.expiry,
      lease_id or '', lease_deadline or '', endpoints}
  end
  return {result, ctx.now, '', '', '', '', lease_id or '', lease_deadline or '', endpoints}
end

-- routing.third_party_share: whether the identity may be admitted on pair p; the admission is
-- recorded when it may. On an unlimited provider it may while its unlimited admissions stay within
-- max share x its admissions + burst, this one counted in both; on any other provider, always.
-- The member is the lease id: a replayed or retried admission never counts twice, and one retried
-- onto an own provider leaves the unlimited count. Integers only (the share in millionths).
local function share_admits(ctx, p, member)
  local s = ctx.share
  if not s then
    return true
  end
  local since = ctx.now - s.window
  redis.call('ZREMRANGEBYSCORE', s.all_key, '-inf', since)
  redis.call('ZREMRANGEBYSCORE', s.unlimited_key, '-inf', since)
  if s.unlimited[p.name] then
    local all = redis.call('ZCARD', s.all_key) + (redis.call('ZSCORE', s.all_key, member) and 0 or 1)
    local unlimited = redis.call('ZCARD', s.unlimited_key) + (redis.call('ZSCORE', s.unlimited_key, member) and 0 or 1)
    if unlimited * 1000000 > s.max_ppm * all + s.burst * 1000000 then
      return false
    end
    redis.call('ZADD', s.unlimited_key, ctx.now, member)
    redis.call('PEXPIRE', s.unlimited_key, s.window)
  else
    redis.call('ZREM', s.unlimited_key, member)
  end
  redis.call('ZADD', s.all_key, ctx.now, member)
  redis.call('PEXPIRE', s.all_key, s.window)
  return true
end

-- An admission retried with the same lease id never admits twice: it gets the first answer back.
local function replayed_admission(ctx, p, lease_id)
  local score = redis.call('ZSCORE', p.leases_key, lease_id)
  if not score then
    return nil
  end
  score = tonumber(score)
  if score <= ctx.now then
    return reply(ctx, 'LEASE_EXPIRED', nil, lease_id, score)
  end
  ctx.endpoints = lease_endpoint(p, lease_id)
  return reply(ctx, 'ADMITTED', read_pin(ctx), lease_id, score)
end

-- The body of try_admit_unpinned_session_request once the session is known to have no live pin.
local function admit_new_pin(ctx, p, lease_id, pin_id)
  tidy_provider(ctx, p)
  ctx.lease_id = lease_id
  local result = capacity_result(ctx, p, earlier_in_flight(ctx, p), false, true)
  if result ~= 'ADMITTED' then
    return reply(ctx, result, nil)
  end
  if not share_admits(ctx, p, lease_id) then
    return reply(ctx, 'THIRD_PARTY_SHARE_REACHED', nil)
  end
  local pin, lease_deadline = create_pin(ctx, p, pin_id, lease_id)
  return reply(ctx, 'ADMITTED', pin, lease_id, lease_deadline)
end

-- The body of try_admit_pinned_session_request once the live pin and its provider are known.
local function admit_on_pin(ctx, p, pin, lease_id)
  tidy_provider(ctx, p)
  ctx.sticky = pin.endpoint  -- affinity pick: the session's endpoint first while under its cap
  ctx.lease_id = lease_id
  local result = capacity_result(ctx, p, session_in_flight_on(ctx, p), true, false)
  if result ~= 'ADMITTED' then
    return reply(ctx, result, pin)
  end
  if not share_admits(ctx, p, lease_id) then
    return reply(ctx, 'THIRD_PARTY_SHARE_REACHED', pin)
  end
  return reply(ctx, 'ADMITTED', pin, lease_id, add_pinned_lease(ctx, p, pin, lease_id))
end

local function unknown_provider(ctx, name)
  return redis.error_reply('ERR unknown provider for this model: ' .. tostring(name))
end

-- The provider an op names first (op ARGV 1), or nil and the error reply for one the model's
-- pairs do not list.
local function op_provider(ctx)
  local name = op_arg(ctx, 1)
  local p = ctx.by_name[name]
  if p then
    return p
  end
  return nil, unknown_provider(ctx, name)
end

-- The leases of a call that renews or releases several (renew.lua, release.lua): the op ARGV holds
-- `width` arguments per lease, the first the provider's name; KEYS[1..3] are the first lease's
-- session keys, and 3 per further lease come last in KEYS. Calls `one(p, i)` (i: the lease's first
-- op argument) for each lease in order with ctx's session keys set to its session's. One lease:
-- its reply, or an error reply for an unknown provider; several: the list of replies, an unknown
-- provider's as {'UNKNOWN_PROVIDER', now, ...}.
local function each_lease(ctx, width, one)
  local n = (#ARGV - ctx.args_at + 1) / width
  if n == 1 then
    local p = ctx.by_name[op_arg(ctx, 1)]
    if not p then
      return unknown_provider(ctx, op_arg(ctx, 1))
    end
    return one(p, 1)
  end
  local further = #KEYS - 3 * (n - 1)
  local replies = {}
  for k = 1, n do
    local i = (k - 1) * width + 1
    if k > 1 then
      local at = further + 3 * (k - 2)
      ctx.pin_key, ctx.session_leases_key, ctx.session_earlier_key = KEYS[at + 1], KEYS[at + 2], KEYS[at + 3]
    end
    local p = ctx.by_name[op_arg(ctx, i)]
    if p then
      replies[k] = one(p, i)
    else
      replies[k] = reply(ctx, 'UNKNOWN_PROVIDER', nil, op_arg(ctx, i + 1))
    end
  end
  return replies
end
