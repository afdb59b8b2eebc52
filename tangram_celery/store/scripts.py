"""The Lua scripts: every transition of an action's state happens in one of these, atomically.

`SUBMIT` and `CANCEL` are run by both clients (sync and async) with the same keys and arguments
(`cancel_keys`, `cancel_args` in `tangram_celery.store.client_ops`).

Every key a script writes is one of its KEYS, never a name it reads or builds: Redis checks
each `redis.call` against the caller's ACL user, and a tenant's user reaches only its own keys
(`transport.acl`). A notification list named in an action's hash is therefore passed in by the
caller, who checked it is the action's tenant's (`WAKE`). A key the caller may only read
(a tenant's `limits`, the workers' `running`) is passed by name in ARGV instead: Redis takes
every declared key of EVAL/EVALSHA as read-write and refuses a read-only one, while the
script's own read of it is checked as the read it is.
"""

# KEYS: the tenant's intake, a:<id>. ARGV: id, meta, payload, cap, ttl, notify, and the name of
# the tenant's limits (read-only to it; see the module doc).
SUBMIT = """
if redis.call('EXISTS', KEYS[2]) == 1 then
  -- Idempotent: the same action submitted again (a retry after a lost reply) is accepted once.
  -- Compared by digest: the payload itself is dropped once the action is done. Its completion
  -- wakes the latest submitter (another client's retry: the first may be gone).
  if redis.call('HGET', KEYS[2], 'digest') == redis.sha1hex(ARGV[3]) then
    if ARGV[6] and ARGV[6] ~= '' then
      redis.call('HSET', KEYS[2], 'notify', ARGV[6])
    else
      redis.call('HDEL', KEYS[2], 'notify')
    end
    return 'already'
  end
  return redis.error_reply('TANGRAM_DUPLICATE')
end
-- ARGV[7]: the tenant's limits, written by the scheduler (`max_queued`: its own bound)
local cap = tonumber(ARGV[4])
local own = tonumber(redis.call('HGET', ARGV[7], 'max_queued') or '0') or 0
if cap > 0 or own > 0 then
  local n = redis.call('XLEN', KEYS[1])
  if own > 0 and n >= own then return redis.error_reply('TANGRAM_FULL tenant ' .. own) end
  if cap > 0 and n >= cap then return redis.error_reply('TANGRAM_FULL') end
end
local entry = redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 'meta', ARGV[2])
redis.call('HSET', KEYS[2], 'meta', ARGV[2], 'payload', ARGV[3], 'digest', redis.sha1hex(ARGV[3]),
           'state', 'queued', 'entry', entry)
-- the asyncio client's notification list (see `WAKE`)
if ARGV[6] and ARGV[6] ~= '' then redis.call('HSET', KEYS[2], 'notify', ARGV[6]) end
local ttl = tonumber(ARGV[5])
if ttl > 0 then redis.call('EXPIRE', KEYS[2], ttl) end
return entry
"""

# dispatched -> running for the current attempt only, returning meta, payload, dispatched_s,
# notify and the scheduler's dispatch record; otherwise the state (or 'stale' for a message of an
# earlier attempt) is returned as a string.
# KEYS: a:<id>. ARGV: worker, now_s, attempt, token, then the order: action id (as `running`
# names it), kind, pool, units, unit ids (comma-joined), then the name of `running` (read-only
# to workers; see the module doc). The token is the claim call's
# own (one per call, the same for its retries): a retry whose first try ran on Redis but lost its
# reply finds its own claim, while a second delivery of the same attempt to the same worker (a
# re-sent message, a redelivered unacknowledged one, taken by another of its threads) is refused
# as 'running'.
# Only the scheduler makes a worker act: an order that is not what the scheduler recorded in
# `running` for this action (its attempt, pool, units and cores; only its attempt when ARGV[6],
# the kind, is empty) is refused as 'unordered', before anything changes.
CLAIM = """
local function ordered()
  local raw = redis.call('HGET', ARGV[10], ARGV[5])
  if not raw then return nil end
  local ok, rec = pcall(cjson.decode, raw)
  if not ok or type(rec) ~= 'table' or type(rec.alloc) ~= 'table' then return nil end
  local a = rec.alloc
  if a.action_id ~= ARGV[5] or (rec.attempt or 1) ~= tonumber(ARGV[3]) then return nil end
  if ARGV[6] ~= '' and (a.kind ~= ARGV[6] or a.pool ~= ARGV[7] or a.units ~= tonumber(ARGV[8])
     or table.concat(a.unit_ids or {}, ',') ~= ARGV[9]) then return nil end
  return raw
end
local s = redis.call('HGET', KEYS[1], 'state')
if s == 'dispatched' then
  if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[3] then return 'stale' end
  local rec = ordered()
  if not rec then return 'unordered' end
  redis.call('HSET', KEYS[1], 'state', 'running', 'worker', ARGV[1], 'started_s', ARGV[2],
             'claim', ARGV[4])
  -- queued too long (limits.queued_ttl_s): the payload expired; the worker reports it
  if redis.call('HEXISTS', KEYS[1], 'payload') == 0 then return 'expired' end
  redis.call('PERSIST', KEYS[1])  -- a started action's record lives until its result's TTL
  local got = redis.call('HMGET', KEYS[1], 'meta', 'payload', 'dispatched_s', 'notify')
  got[5] = rec
  return got
end
if s == 'running' and redis.call('HGET', KEYS[1], 'claim') == ARGV[4]
   and redis.call('HGET', KEYS[1], 'worker') == ARGV[1]
   and redis.call('HGET', KEYS[1], 'attempt') == ARGV[3] then
  -- This very call's claim, whose reply was lost (Redis went away): idempotent.
  local rec = ordered()
  if not rec then return 'unordered' end
  local got = redis.call('HMGET', KEYS[1], 'meta', 'payload', 'dispatched_s', 'notify')
  got[5] = rec
  return got
end
if not s then return 'missing' end
return s
"""

# running -> done: store the result, notify the client, tell the scheduler. Exactly once.
# KEYS: a:<id>, n:<id>, events, the notification list (`WAKE`). Returns 0 if it was final
# already, 1, or the list the hash names instead of KEYS[4] (its caller wakes it: `NOTIFY`).
# running (by the worker presumed dead) -> dispatched (retry) or queued (re-route), next attempt.
# KEYS: a:<id>, running. ARGV: worker, state, attempt, now, the action's id in `running` and its
# dispatch record as of the new attempt ("" to leave it: a re-route writes one when it dispatches).
REQUEUE = """
local s = redis.call('HGET', KEYS[1], 'state')
if s == 'done' or s == false then return 0 end
if s == 'running' and redis.call('HGET', KEYS[1], 'worker') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'attempt', ARGV[3], 'dispatched_s', ARGV[4])
if ARGV[6] ~= '' then redis.call('HSET', KEYS[2], ARGV[5], ARGV[6]) end
return 1
"""

# running (by this worker, this attempt) -> queued, and tell the scheduler to place it again:
# a retryable infrastructure failure (e.g. a reward server that crashed mid-batch).
GIVE_BACK = """
local s = redis.call('HGET', KEYS[1], 'state')
if s ~= 'running' or redis.call('HGET', KEYS[1], 'worker') ~= ARGV[1]
   or redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'state', 'queued')
redis.call('XADD', KEYS[2], '*', 'id', ARGV[3], 'event', ARGV[4])
return 1
"""

HEARTBEAT = """
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], ARGV[1], t[1] + t[2] / 1e6)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""

# Wake whoever waits for the result, with the result itself (no second read): the asyncio
# client's per-process list if the action names one, else the action's own list (BLPOP).
# KEYS[4] is that list as the caller read it from the hash and checked it (its own tenant's;
# `keys.notify_prefix`), or the action's own list: the push goes there only if the hash still
# names it, so no caller can make a script push onto a list of its choosing. A hash that names
# another list since (a retry of the submit from another client: `SUBMIT`) leaves it in
# `other`: the completion returns it for its caller to check and wake (`NOTIFY`).
WAKE = """
local q = redis.call('HGET', KEYS[1], 'notify')
local other = false
if q and q == KEYS[4] then
  redis.call('RPUSH', KEYS[4], ARGV[2])
  redis.call('EXPIRE', KEYS[4], ARGV[4])
elseif q then
  other = q
else
  redis.call('RPUSH', KEYS[2], ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
"""

# The second half of a wake-up whose hash named another list than its completion was given
# (`WAKE`'s `other`), once its caller checked that list: push the result there if the hash
# still names it, else onto the action's own list. KEYS: a:<id>, n:<id>, the list. ARGV: the
# result, its TTL.
NOTIFY = """
local target = KEYS[2]
if redis.call('HGET', KEYS[1], 'notify') == KEYS[3] then target = KEYS[3] end
redis.call('RPUSH', target, ARGV[1])
redis.call('EXPIRE', target, ARGV[2])
return 1
"""

COMPLETE = (
    """
local s = redis.call('HGET', KEYS[1], 'state')
if s == 'done' or s == 'cancelled' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'done', 'result', ARGV[2])
redis.call('HDEL', KEYS[1], 'payload')  -- no longer needed: free the broker's memory now
redis.call('EXPIRE', KEYS[1], ARGV[4])
"""
    + WAKE
    + """
redis.call('XADD', KEYS[3], '*', 'id', ARGV[1], 'event', ARGV[3])
return other or 1
"""
)

# queued -> cancelled, only for an action that was never dispatched (no attempt yet): a caller
# told that its action failed must be able to rely on it never running. The intake entry goes
# (so it no longer counts against the intake bound and is never read), the result is stored
# and the waiter woken like a completion, and the scheduler is told to drop the action from its
# waiting queue (a `cancel` control entry on the tenant's own intake). `DISPATCH` dispatches only
# actions still queued, so a scheduler that decided on the action before it read the notice
# does not run it either.
# KEYS: a:<id>, n:<id>, the tenant's intake, the notification list (`WAKE`).
# ARGV: id (the caller's), result, (unused), ttl, group.
CANCEL = (
    """
local s = redis.call('HGET', KEYS[1], 'state')
if not s then return 'missing' end
if s ~= 'queued' or redis.call('HEXISTS', KEYS[1], 'attempt') == 1 then return s end
local entry = redis.call('HGET', KEYS[1], 'entry')
if entry then
  redis.pcall('XACK', KEYS[3], ARGV[5], entry)  -- no group yet: nothing to acknowledge
  redis.call('XDEL', KEYS[3], entry)
end
redis.call('HSET', KEYS[1], 'state', 'cancelled', 'result', ARGV[2])
redis.call('HDEL', KEYS[1], 'payload')  -- it will never run: free the broker's memory now
redis.call('EXPIRE', KEYS[1], ARGV[4])
"""
    + WAKE
    + """
if other then  -- its waiter polls the hash; no list is named that the caller did not check
  redis.call('RPUSH', KEYS[2], ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
redis.call('XADD', KEYS[3], '*', 'control', 'cancel', 'id', ARGV[1])
return 'cancelled'
"""
)

# Persist allocations (queued -> dispatched) and take their entries off the intakes, atomically;
# an action no longer queued (cancelled meanwhile) is skipped and returned.
# KEYS: running, traj, reset, then the s intake streams the entries are on, then a:<id> per record.
# ARGV: group, now, n, s, then (id, record, attempt) per record, then m, then (trajectory, pin)
# per pin, then the pins to forget, the resets to mark and to unmark (each counted first), then
# per intake stream: its count of entry ids, and those ids.
DISPATCH = """
local group, now, n, streams = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local skipped = {}
local i = 5
for k = 1, n do
  local id, rec, attempt = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  i = i + 3
  local key = KEYS[3 + streams + k]
  if redis.call('HGET', key, 'state') == 'queued' then
    redis.call('HSET', KEYS[1], id, rec)
    redis.call('HSET', key, 'state', 'dispatched', 'dispatched_s', now, 'attempt', attempt)
  else
    skipped[#skipped + 1] = id
  end
end
local m = tonumber(ARGV[i])
i = i + 1
for k = 1, m do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  i = i + 2
end
-- evicted trajectories: their pins go, and they are marked reset; resets consumed are unmarked
local f = tonumber(ARGV[i])
i = i + 1
for k = 1, f do
  redis.call('HDEL', KEYS[2], ARGV[i])
  i = i + 1
end
local r = tonumber(ARGV[i])
i = i + 1
for k = 1, r do
  redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
  i = i + 2
end
local d = tonumber(ARGV[i])
i = i + 1
for k = 1, d do
  redis.call('HDEL', KEYS[3], ARGV[i])
  i = i + 1
end
for s = 1, streams do
  local stream = KEYS[3 + s]
  local last_of_stream = i + tonumber(ARGV[i])
  i = i + 1
  while i <= last_of_stream do
    local last = math.min(i + 499, last_of_stream)
    redis.call('XACK', stream, group, unpack(ARGV, i, last))
    redis.call('XDEL', stream, unpack(ARGV, i, last))
    i = last + 1
  end
end
return skipped
"""
