-- The admission queue (docs/queue.md), appended after lib.lua to every routing script. It is on for
-- a call only when the call's ARGV queue section starts with "1"; otherwise ctx.queue is nil and
-- nothing here runs: the spec's rules apply exactly.
--
-- ARGV queue section (where lib.lua's read_context finds it): "0", or "1" then the ticket lease
-- ms, the request's class rank (0 = highest priority), whether its class may use the slots
-- reserved for pinned sessions ("1"/"0"), its tenant (a keyed hash of its identity), its ticket id
-- ("" for none), the mode ("none": never queue; "join": queue when refused for slots; "wait": the
-- ticket must exist), the class's max depth per pair, the wake-up channel.
-- KEYS after the providers' pins and leases (and routing.third_party_share's two, when on): the model's tickets (zset: id -> deadline ms), its
-- queue state (hash), its finish tags (zset), then per provider (in ARGV order) its queue and its
-- reserved queue (zsets: ticket id -> score).
--
-- score = class rank x 2^50 + round x 2^20 + arrival (below 2^20, renumber_tickets): strict priority
-- between classes, start-time fair queueing between tenants inside a class (round), arrival order
-- inside a round.
-- Queue state fields: "t:<ticket>" -> "<class>|<round>|<score>|<tenant>"; "v:<class>" -> the
-- highest round served; "n:<class>|<tenant>" -> the tenant's live tickets; "seq" -> arrivals.
-- Finish tags: "<class>|<tenant>" -> class x 2^50 + the round after the tenant's latest ticket.

local QUEUE_CLASS_SPAN = 1125899906842624  -- 2^50
local QUEUE_ROUND_SPAN = 1048576  -- 2^20
local QUEUE_MAX_ROUND = 1073741823  -- 2^30 - 1: a round never reaches the next class
local QUEUE_RENUMBER_ROUND = 536870912  -- 2^29: a class's rounds start again well before the cap
local TICKET_PURGE_BATCH = 64
local NOT_WAITED_FOR = {PIN_LIMIT_REACHED = true, PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED = true}

-- Scores exceed the 14 digits Lua's number-to-string conversion keeps: always format them whole.
local function exact(n)
  return string.format('%.0f', n)
end

queue_section = function(ctx, at, n, base)
  if ARGV[at] ~= '1' then
    return at + 1
  end
  local q = {
    lease = tonumber(ARGV[at + 1]),
    class = tonumber(ARGV[at + 2]),
    may_reserve = ARGV[at + 3] == '1',
    tenant = ARGV[at + 4],
    ticket = ARGV[at + 5],
    mode = ARGV[at + 6],
    max_depth = tonumber(ARGV[at + 7]),
    channel = ARGV[at + 8],
    tickets_key = KEYS[base],
    state_key = KEYS[base + 1],
    finish_key = KEYS[base + 2],
    pairs = {},
  }
  for i = 1, n do
    local p = ctx.by_name[ARGV[5 + (i - 1) * 5 + 1]]
    p.queue_key = KEYS[base + 1 + 2 * i]
    p.reserved_queue_key = KEYS[base + 2 + 2 * i]
    q.pairs[i] = p
  end
  ctx.queue = q
  return at + 9
end

local function queue_ttl(ctx)
  return ctx.queue.lease + ctx.grace
end

local function ticket_record(ctx, id)
  local raw = redis.call('HGET', ctx.queue.state_key, 't:' .. id)
  if not raw then
    return nil
  end
  local class, round, score, tenant = string.match(raw, '^(%d+)|(%d+)|(%d+)|(.*)$')
  return {id = id, class = tonumber(class), round = tonumber(round), score = score, tenant = tenant}
end

local function head_of(key)
  return redis.call('ZRANGE', key, 0, 0)[1]
end

-- Tell the waiters of pair p whose ticket heads one of its queues that they may find a slot.
local function publish_heads(ctx, p)
  local head, reserved_head = head_of(p.queue_key), head_of(p.reserved_queue_key)
  if head or reserved_head then
    redis.call('PUBLISH', ctx.queue.channel, p.name .. ' ' .. (head or '-') .. ' ' .. (reserved_head or '-'))
  end
end

-- Remove ticket `id` from every queue of the model and from the tickets; `served`: it took a slot
-- (the class's round moves on), else the tenant's finish tag is forgotten once it has no ticket
-- left, so a wait in vain costs it nothing later. Wakes the new heads of the queues it headed.
-- Returns whether the ticket existed.
queue_drop_ticket = function(ctx, id, served)
  local q = ctx.queue
  local headed = {}
  for _, p in ipairs(q.pairs) do
    for _, key in ipairs({p.queue_key, p.reserved_queue_key}) do
      if redis.call('ZRANK', key, id) == 0 then
        headed[#headed + 1] = p
      end
      redis.call('ZREM', key, id)
    end
  end
  local existed = redis.call('ZREM', q.tickets_key, id) > 0
  local record = ticket_record(ctx, id)
  if record then
    redis.call('HDEL', q.state_key, 't:' .. id)
    local tenant = record.class .. '|' .. record.tenant
    if redis.call('HINCRBY', q.state_key, 'n:' .. tenant, -1) <= 0 then
      redis.call('HDEL', q.state_key, 'n:' .. tenant)
      if not served then
        redis.call('ZREM', q.finish_key, tenant)
      end
    end
    local served_field = 'v:' .. record.class
    if served and record.round > (tonumber(redis.call('HGET', q.state_key, served_field)) or 0) then
      redis.call('HSET', q.state_key, served_field, record.round)
      -- Finish tags at or below the round served put nobody behind anyone any more.
      local base = record.class * QUEUE_CLASS_SPAN
      redis.call('ZREMRANGEBYSCORE', q.finish_key, exact(base), exact(base + record.round))
    end
  end
  for _, p in ipairs(headed) do
    publish_heads(ctx, p)
  end
  return existed or record ~= nil
end

-- Memory and order: tickets whose lease ended (their proxy crashed or froze) leave every queue.
local function purge_expired_tickets(ctx)
  local expired = redis.call('ZRANGEBYSCORE', ctx.queue.tickets_key, '-inf', ctx.now, 'LIMIT', 0, TICKET_PURGE_BATCH)
  for _, id in ipairs(expired) do
    queue_drop_ticket(ctx, id, false)
  end
end

-- The first live ticket of queue `key` with a score below `below` (nil: any); a ticket found
-- there without a live lease is removed first, so no ghost ever stands ahead of live tickets.
local function first_live(ctx, key, below)
  while true do
    local found
    if below then
      found = redis.call('ZRANGEBYSCORE', key, '-inf', '(' .. below, 'LIMIT', 0, 1)[1]
    else
      found = head_of(key)
    end
    if not found then
      return nil
    end
    local deadline = tonumber(redis.call('ZSCORE', ctx.queue.tickets_key, found))
    if deadline and deadline > ctx.now then
      return found
    end
    queue_drop_ticket(ctx, found, false)
  end
end

-- A slot of pair p was freed (a release, an abandonment): wake its heads.
queue_wake = function(ctx, p)
  purge_expired_tickets(ctx)
  publish_heads(ctx, p)
end

local function own_ticket(ctx)
  local q = ctx.queue
  if q.ticket == '' then
    return nil
  end
  local deadline = tonumber(redis.call('ZSCORE', q.tickets_key, q.ticket))
  if not deadline or deadline <= ctx.now then
    return nil
  end
  redis.call('ZADD', q.tickets_key, 'XX', ctx.now + q.lease, q.ticket)  -- every attempt renews it
  extend_ttl(q.tickets_key, queue_ttl(ctx))
  extend_ttl(q.state_key, queue_ttl(ctx))
  extend_ttl(q.finish_key, queue_ttl(ctx))
  return ticket_record(ctx, q.ticket)
end

-- After a long uptime (the queue's state never idled long enough to expire): when the arrival
-- counter reaches 2^20 or a round of the class reaches 2^29, every waiting ticket is renumbered in
-- its order (its class's rounds from the round last served, arrivals from 0), as are the finish
-- tags of those classes, so neither the counter's wrap nor the round cap reorders anyone (issue
-- 29). O(waiting tickets), once per 2^20 arrivals.
local function renumber_tickets(ctx)
  local q = ctx.queue
  local tickets = {}
  for _, id in ipairs(redis.call('ZRANGE', q.tickets_key, 0, -1)) do
    tickets[#tickets + 1] = ticket_record(ctx, id)
  end
  table.sort(tickets, function(x, y) return tonumber(x.score) < tonumber(y.score) end)
  local shifts = {}
  local function shift_of(class)
    if not shifts[class] then
      shifts[class] = tonumber(redis.call('HGET', q.state_key, 'v:' .. class)) or 0
      redis.call('HSET', q.state_key, 'v:' .. class, 0)
      local base = class * QUEUE_CLASS_SPAN
      local tags = redis.call('ZRANGEBYSCORE', q.finish_key, exact(base), '(' .. exact(base + QUEUE_CLASS_SPAN), 'WITHSCORES')
      for i = 1, #tags, 2 do
        redis.call('ZADD', q.finish_key, exact(base + math.max(0, tonumber(tags[i + 1]) - base - shifts[class])), tags[i])
      end
    end
    return shifts[class]
  end
  shift_of(q.class)
  for i, t in ipairs(tickets) do
    local round = math.max(0, t.round - shift_of(t.class))
    local score = exact(t.class * QUEUE_CLASS_SPAN + round * QUEUE_ROUND_SPAN + i - 1)
    redis.call('HSET', q.state_key, 't:' .. t.id, t.class .. '|' .. exact(round) .. '|' .. score .. '|' .. t.tenant)
    for _, p in ipairs(q.pairs) do
      for _, key in ipairs({p.queue_key, p.reserved_queue_key}) do
        redis.call('ZADD', key, 'XX', score, t.id)
      end
    end
  end
  redis.call('HSET', q.state_key, 'seq', #tickets)
end

local function fair_round(ctx, tenant)
  local q = ctx.queue
  local round = tonumber(redis.call('HGET', q.state_key, 'v:' .. q.class)) or 0
  local finish = tonumber(redis.call('ZSCORE', q.finish_key, tenant))
  if finish then
    round = math.max(round, finish - q.class * QUEUE_CLASS_SPAN)
  end
  return round
end

local function new_ticket(ctx)
  local q = ctx.queue
  local tenant = q.class .. '|' .. q.tenant
  local round = fair_round(ctx, tenant)
  local arrival = redis.call('HINCRBY', q.state_key, 'seq', 1)
  if arrival >= QUEUE_ROUND_SPAN or round >= QUEUE_RENUMBER_ROUND then
    renumber_tickets(ctx)
    round = fair_round(ctx, tenant)
    arrival = redis.call('HINCRBY', q.state_key, 'seq', 1)
  end
  round = math.min(round, QUEUE_MAX_ROUND)
  local score = exact(q.class * QUEUE_CLASS_SPAN + round * QUEUE_ROUND_SPAN + arrival)
  redis.call('ZADD', q.finish_key, exact(q.class * QUEUE_CLASS_SPAN + round + 1), tenant)
  redis.call('HINCRBY', q.state_key, 'n:' .. tenant, 1)
  redis.call('HSET', q.state_key, 't:' .. q.ticket, q.class .. '|' .. exact(round) .. '|' .. score .. '|' .. q.tenant)
  redis.call('ZADD', q.tickets_key, ctx.now + q.lease, q.ticket)
  extend_ttl(q.tickets_key, queue_ttl(ctx))
  extend_ttl(q.state_key, queue_ttl(ctx))
  extend_ttl(q.finish_key, queue_ttl(ctx))
  return {id = q.ticket, class = q.class, round = round, score = score, tenant = q.tenant}
end

local function depth_full(ctx, p, class)
  local base = class * QUEUE_CLASS_SPAN
  return redis.call('ZCOUNT', p.queue_key, exact(base), '(' .. exact(base + QUEUE_CLASS_SPAN)) >= ctx.queue.max_depth
end

local function join_pair(ctx, p, ticket, reserved)
  redis.call('ZADD', p.queue_key, ticket.score, ticket.id)
  extend_ttl(p.queue_key, queue_ttl(ctx))
  if reserved then
    redis.call('ZADD', p.reserved_queue_key, ticket.score, ticket.id)
    extend_ttl(p.reserved_queue_key, queue_ttl(ctx))
  end
end

-- The ticket no longer waits for pair p (a pin limit or its session's own limit holds there).
local function leave_pair(ctx, p, id)
  local headed = redis.call('ZRANK', p.queue_key, id) == 0 or redis.call('ZRANK', p.reserved_queue_key, id) == 0
  redis.call('ZREM', p.queue_key, id)
  redis.call('ZREM', p.reserved_queue_key, id)
  if headed then
    publish_heads(ctx, p)
  end
end

-- The gate of every admission on pair p (lib.lua's capacity_result): `result` is the spec's answer,
-- `reserved` whether this admission may use the reserved slots, `pinned` whether it is a request
-- on its session's pin. Returns the answer: ADMITTED only when nobody waits ahead for the room the
-- admission would use (the hand-over: the queue's head takes a freed slot, never a newcomer);
-- QUEUED when the request's ticket waits in p's queue; TICKET_LOST when a waiting ticket is gone;
-- else a refusal the spec's rules know for that admission. A pinned admission the gate refuses
-- (someone waits ahead, its class's queue is full, it may not wait: a class that does not wait, a
-- drain) finds the pair full, GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED, as the spec's capacity
-- answers on a pin are, so the router offloads it with its pin kept (the spec's
-- execute_pinned_request); UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED is never a pin's answer.
queue_gate = function(ctx, p, result, reserved, pinned)
  local q = ctx.queue
  purge_expired_tickets(ctx)
  local own = own_ticket(ctx)
  if not own and q.mode == 'wait' then
    return 'TICKET_LOST'
  end
  if NOT_WAITED_FOR[result] then
    if own then
      leave_pair(ctx, p, own.id)
    end
    return result
  end
  if p.max_global == NO_LIMIT then
    if own and result == 'ADMITTED' then  -- served where nobody waits: it waits nowhere any more
      queue_drop_ticket(ctx, own.id, false)
    end
    return result
  end
  local key = p.queue_key
  if live_count(p.leases_key, ctx.now) >= p.max_global - p.reserved then
    key = p.reserved_queue_key  -- only reserved slots are free: they go to the reserved queue's head
  end
  local refusal = result
  if result == 'ADMITTED' then
    local first = first_live(ctx, key, nil)
    if first == nil or (own and first == own.id) then
      if own then
        queue_drop_ticket(ctx, own.id, true)
      end
      return 'ADMITTED'
    end
    if not own and not first_live(ctx, key, exact((q.class + 1) * QUEUE_CLASS_SPAN)) then
      return 'ADMITTED'  -- only lower classes wait: strict priority
    end
    refusal = pinned and 'GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED' or 'UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED'
  end
  local queued = own and redis.call('ZSCORE', p.queue_key, own.id)
  if not queued then
    if q.mode ~= 'join' or depth_full(ctx, p, q.class) then
      return refusal
    end
    own = own or new_ticket(ctx)
  end
  join_pair(ctx, p, own, reserved)
  if result == 'ADMITTED' and first_live(ctx, key, nil) == own.id then
    queue_drop_ticket(ctx, own.id, true)  -- its fair place is the head: it takes the slot now
    return 'ADMITTED'
  end
  return 'QUEUED'
end
