"""The Lua scripts: every transition of an action's state happens in one of these, atomically.

`SUBMIT` and `CANCEL` are run by both clients (sync and async) with the same keys and arguments
(`cancel_keys`, `cancel_args` in `tangram_celery.store.client_side`).
"""

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
local cap = tonumber(ARGV[4])
if cap > 0 and redis.call('XLEN', KEYS[1]) >= cap then return redis.error_reply('TANGRAM_FULL') end
local entry = redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 'meta', ARGV[2])
redis.call('HSET', KEYS[2], 'meta', ARGV[2], 'payload', ARGV[3], 'digest', redis.sha1hex(ARGV[3]),
           'state', 'queued', 'entry', entry)
-- the asyncio client's notification list (see `WAKE`)
if ARGV[6] and ARGV[6] ~= '' then redis.call('HSET', KEYS[2], 'notify', ARGV[6]) end
local ttl = tonumber(ARGV[5])
if ttl > 0 then redis.call('EXPIRE', KEYS[2], ttl) end
return entry
"""

# dispatched -> running for the current attempt only, returning meta and payload; otherwise the
# state (or 'stale' for a message of an earlier attempt) is returned as a string.
# ARGV: worker, now_s, attempt, token. The token is the claim call's own (one per call, the same
# for its retries): a retry whose first try ran on Redis but lost its reply finds its own claim,
# while a second delivery of the same attempt to the same worker (a re-sent message, a
# redelivered unacknowledged one, taken by another of its threads) is refused as 'running'.
CLAIM = """
local s = redis.call('HGET', KEYS[1], 'state')
if s == 'dispatched' then
  if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[3] then return 'stale' end
  redis.call('HSET', KEYS[1], 'state', 'running', 'worker', ARGV[1], 'started_s', ARGV[2],
             'claim', ARGV[4])
  -- queued too long (limits.queued_ttl_s): the payload expired; the worker reports it
  if redis.call('HEXISTS', KEYS[1], 'payload') == 0 then return 'expired' end
  redis.call('PERSIST', KEYS[1])  -- a started action's record lives until its result's TTL
  return redis.call('HMGET', KEYS[1], 'meta', 'payload', 'dispatched_s')
end
if s == 'running' and redis.call('HGET', KEYS[1], 'claim') == ARGV[4]
   and redis.call('HGET', KEYS[1], 'worker') == ARGV[1]
   and redis.call('HGET', KEYS[1], 'attempt') == ARGV[3] then
  -- This very call's claim, whose reply was lost (Redis went away): idempotent.
  return redis.call('HMGET', KEYS[1], 'meta', 'payload', 'dispatched_s')
end
if not s then return 'missing' end
return s
"""

# running -> done: store the result, notify the client, tell the scheduler. Exactly once.
# running (by the worker presumed dead) -> dispatched (retry) or queued (re-route), next attempt.
REQUEUE = """
local s = redis.call('HGET', KEYS[1], 'state')
if s == 'done' or s == false then return 0 end
if s == 'running' and redis.call('HGET', KEYS[1], 'worker') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'attempt', ARGV[3], 'dispatched_s', ARGV[4])
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
WAKE = """
local q = redis.call('HGET', KEYS[1], 'notify')
if q then
  redis.call('RPUSH', q, ARGV[2])
  redis.call('EXPIRE', q, ARGV[4])
else
  redis.call('RPUSH', KEYS[2], ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
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
return 1
"""
)

# queued -> cancelled, only for an action that was never dispatched (no attempt yet): a caller
# told that its action failed must be able to rely on it never running. The intake entry goes
# (so it no longer counts against the intake bound and is never read), the result is stored
# and the waiter woken like a completion, and the scheduler is told to drop the action from its
# waiting queue. `DISPATCH` dispatches only actions still queued, so a scheduler that decided
# on the action before it read the event does not run it either.
CANCEL = (
    """
local s = redis.call('HGET', KEYS[1], 'state')
if not s then return 'missing' end
if s ~= 'queued' or redis.call('HEXISTS', KEYS[1], 'attempt') == 1 then return s end
local entry = redis.call('HGET', KEYS[1], 'entry')
if entry then
  redis.pcall('XACK', KEYS[4], ARGV[5], entry)  -- no group yet: nothing to acknowledge
  redis.call('XDEL', KEYS[4], entry)
end
redis.call('HSET', KEYS[1], 'state', 'cancelled', 'result', ARGV[2])
redis.call('HDEL', KEYS[1], 'payload')  -- it will never run: free the broker's memory now
redis.call('EXPIRE', KEYS[1], ARGV[4])
"""
    + WAKE
    + """
redis.call('XADD', KEYS[3], '*', 'id', ARGV[1], 'event', ARGV[3])
return 'cancelled'
"""
)

# Persist allocations (queued -> dispatched) and take their entries off the intake, atomically;
# an action no longer queued (cancelled meanwhile) is skipped and returned.
# KEYS: running, traj, intake, then a:<id> per record.
# ARGV: group, now, n, then (id, record, attempt) per record, then m, then (trajectory, pin) per
# pin, then the intake entry ids.
DISPATCH = """
local group, now, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
local skipped = {}
local i = 4
for k = 1, n do
  local id, rec, attempt = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  i = i + 3
  local key = KEYS[4 + k]
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
  redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 1])
  i = i + 2
end
local d = tonumber(ARGV[i])
i = i + 1
for k = 1, d do
  redis.call('HDEL', KEYS[4], ARGV[i])
  i = i + 1
end
while i <= #ARGV do
  local last = math.min(i + 499, #ARGV)
  redis.call('XACK', KEYS[3], group, unpack(ARGV, i, last))
  redis.call('XDEL', KEYS[3], unpack(ARGV, i, last))
  i = last + 1
end
return skipped
"""
