"""Tangram's state in Redis: one interface for everything the client, scheduler and workers share.

Keys (all under `tangram:`):
  intake            stream of submitted action metadata and control messages (group `sched`);
                    its length is the number of actions not yet dispatched (entries are deleted
                    on dispatch), which bounds the intake
  events            stream of completion events from workers (group `sched`)
  a:<id>            hash per action: meta, payload, state, timings, result
  n:<id>            list the client blocks on; one element pushed when the result is written
  running           hash action id -> allocation + metadata of every dispatched, unfinished action
  traj              hash trajectory id -> pinned CPU node, reserved memory, sandbox generation
                    and owner (scheduler/service/sandboxes.py)
  reset             hash trajectory id -> time its sandbox was lost (evicted, expired, worker gone)
  sandboxes         hash CPU worker -> the sandboxes it holds and its completion counter
  dead              dead-letter stream: malformed intake entries and why (bounded)
  config            the scheduler's published view of pools and models (for client validation)
  nq:<client>       list of the results of one asyncio client process (`notify` field of the
                    action's hash): one connection waits on it for all that process's results
                    instead of one BLPOP per action
  warm              hash GPU node -> its warm-up status (JSON: state, services, loaded, seconds)

Action states: queued -> dispatched -> running -> done, and queued -> cancelled (only an action
that was never dispatched; see `cancel`). Transitions happen only in the Lua scripts below, so
a duplicate Celery message can never run an action twice and a cancelled action never runs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

import redis

from tangram_celery.errors import ActionRejected, AdmissionError, BrokerError

log = logging.getLogger("tangram.store")
T = TypeVar("T")

P = "tangram:"
INTAKE = P + "intake"
EVENTS = P + "events"
RUNNING = P + "running"
TRAJ = P + "traj"
CONFIG = P + "config"
DEAD = P + "dead"  # dead-letter stream: malformed intake entries, with the reason
DEAD_MAXLEN = 10_000
WORKERS = P + "workers"  # worker name -> last heartbeat (Redis server time, s)
WORKER_POOLS = P + "worker_pools"  # worker name -> pool key "cpu:n0" / "api:calc" / "gpu:g0"
SANDBOXES = P + "sandboxes"  # CPU worker name -> JSON {"seq", "held": [[trajectory, generation]]}
RESETS = P + "reset"  # trajectory -> when its sandbox was lost (its next result says so)
WARM = P + "warm"  # GPU node -> warm-up status (JSON)
GROUP = "sched"
CONSUMER = "scheduler"
RESULT_TTL_S = 24 * 3600


class ActionState(StrEnum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"


def akey(action_id: str) -> str:
    return f"{P}a:{action_id}"


def nkey(action_id: str) -> str:
    return f"{P}n:{action_id}"


def notify_key(client_id: str) -> str:
    return f"{P}nq:{client_id}"


_SUBMIT = """
if redis.call('EXISTS', KEYS[2]) == 1 then
  -- Idempotent: the same action submitted again (a retry after a lost reply) is accepted once.
  -- Compared by digest: the payload itself is dropped once the action is done.
  if redis.call('HGET', KEYS[2], 'digest') == redis.sha1hex(ARGV[3]) then return 'already' end
  return redis.error_reply('TANGRAM_DUPLICATE')
end
local cap = tonumber(ARGV[4])
if cap > 0 and redis.call('XLEN', KEYS[1]) >= cap then return redis.error_reply('TANGRAM_FULL') end
local entry = redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 'meta', ARGV[2])
redis.call('HSET', KEYS[2], 'meta', ARGV[2], 'payload', ARGV[3], 'digest', redis.sha1hex(ARGV[3]),
           'state', 'queued', 'entry', entry)
-- the asyncio client's notification list (see `_WAKE`)
if ARGV[6] and ARGV[6] ~= '' then redis.call('HSET', KEYS[2], 'notify', ARGV[6]) end
local ttl = tonumber(ARGV[5])
if ttl > 0 then redis.call('EXPIRE', KEYS[2], ttl) end
return entry
"""

# dispatched -> running for the current attempt only, returning meta and payload; otherwise the
# state (or 'stale' for a message of an earlier attempt) is returned as a string.
_CLAIM = """
local s = redis.call('HGET', KEYS[1], 'state')
if s == 'dispatched' then
  if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[3] then return 'stale' end
  redis.call('HSET', KEYS[1], 'state', 'running', 'worker', ARGV[1], 'started_s', ARGV[2])
  -- queued too long (limits.queued_ttl_s): the payload expired; the worker reports it
  if redis.call('HEXISTS', KEYS[1], 'payload') == 0 then return 'expired' end
  redis.call('PERSIST', KEYS[1])  -- a started action's record lives until its result's TTL
  return redis.call('HMGET', KEYS[1], 'meta', 'payload', 'dispatched_s')
end
if s == 'running' and redis.call('HGET', KEYS[1], 'worker') == ARGV[1]
   and redis.call('HGET', KEYS[1], 'attempt') == ARGV[3] then
  -- Our own claim whose reply was lost (Redis went away): idempotent.
  return redis.call('HMGET', KEYS[1], 'meta', 'payload', 'dispatched_s')
end
if not s then return 'missing' end
return s
"""

# running -> done: store the result, notify the client, tell the scheduler. Exactly once.
# running (by the worker presumed dead) -> dispatched (retry) or queued (re-route), next attempt.
_REQUEUE = """
local s = redis.call('HGET', KEYS[1], 'state')
if s == 'done' or s == false then return 0 end
if s == 'running' and redis.call('HGET', KEYS[1], 'worker') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'attempt', ARGV[3], 'dispatched_s', ARGV[4])
return 1
"""

# running (by this worker, this attempt) -> queued, and tell the scheduler to place it again:
# a retryable infrastructure failure (e.g. a reward server that crashed mid-batch).
_GIVE_BACK = """
local s = redis.call('HGET', KEYS[1], 'state')
if s ~= 'running' or redis.call('HGET', KEYS[1], 'worker') ~= ARGV[1]
   or redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'state', 'queued')
redis.call('XADD', KEYS[2], '*', 'id', ARGV[3], 'event', ARGV[4])
return 1
"""

_HEARTBEAT = """
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], ARGV[1], t[1] + t[2] / 1e6)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""

# Wake whoever waits for the result, with the result itself (no second read): the asyncio
# client's per-process list if the action names one, else the action's own list (BLPOP).
_WAKE = """
local q = redis.call('HGET', KEYS[1], 'notify')
if q then
  redis.call('RPUSH', q, ARGV[2])
  redis.call('EXPIRE', q, ARGV[4])
else
  redis.call('RPUSH', KEYS[2], ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
"""

_COMPLETE = (
    """
local s = redis.call('HGET', KEYS[1], 'state')
if s == 'done' or s == 'cancelled' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'done', 'result', ARGV[2])
redis.call('HDEL', KEYS[1], 'payload')  -- no longer needed: free the broker's memory now
redis.call('EXPIRE', KEYS[1], ARGV[4])
"""
    + _WAKE
    + """
redis.call('XADD', KEYS[3], '*', 'id', ARGV[1], 'event', ARGV[3])
return 1
"""
)

# queued -> cancelled, only for an action that was never dispatched (no attempt yet): a caller
# told that its action failed must be able to rely on it never running. The intake entry goes
# (so it no longer counts against the intake bound and is never read), the result is stored
# and the waiter woken like a completion, and the scheduler is told to drop the action from its
# waiting queue. `_DISPATCH` dispatches only actions still queued, so a scheduler that decided
# on the action before it read the event does not run it either.
_CANCEL = (
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
    + _WAKE
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
_DISPATCH = """
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


@dataclass(frozen=True)
class IntakeEntry:
    stream_id: str
    fields: dict[str, str]


class Store:
    """Thin typed wrapper over one Redis connection pool."""

    def __init__(self, url: str, *, socket_timeout_s: float | None = 30.0, retry_budget_s: float = 120.0):
        self.url = url
        self.retry_budget_s = retry_budget_s
        self.r = redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=socket_timeout_s, health_check_interval=30
        )
        self._submit = self.r.register_script(_SUBMIT)
        self._claim = self.r.register_script(_CLAIM)
        self._complete = self.r.register_script(_COMPLETE)
        self._requeue = self.r.register_script(_REQUEUE)
        self._give_back = self.r.register_script(_GIVE_BACK)
        self._heartbeat = self.r.register_script(_HEARTBEAT)
        self._cancel = self.r.register_script(_CANCEL)
        self._dispatch = self.r.register_script(_DISPATCH)
        self._mem: tuple[int, int] = (0, 0)  # (used, max) bytes of Redis memory, last read
        self._mem_checked_s = float("-inf")

    def retrying(self, what: str, fn: Callable[[], T], budget_s: float | None = None) -> T:
        """Run `fn`, retrying with backoff while Redis is unreachable (restarts, failovers).

        Only idempotent operations go through here. Raises BrokerError when the budget is spent.
        """
        deadline = time.monotonic() + (self.retry_budget_s if budget_s is None else budget_s)
        delay_s = 0.05
        while True:
            try:
                return fn()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if time.monotonic() + delay_s > deadline:
                    raise BrokerError(f"{what}: Redis at {redact(self.url)} unreachable: {e}") from e
                log.warning("%s: Redis unreachable (%s); retrying in %.2fs", what, e, delay_s)
                time.sleep(delay_s)
                delay_s = min(delay_s * 2, 1.0)

    def ping(self) -> None:
        try:
            self.r.ping()
        except redis.RedisError as e:
            raise BrokerError(f"cannot reach Redis at {redact(self.url)}: {e}") from e

    def close(self) -> None:
        self.r.close()

    # ---- client side ----------------------------------------------------------------------
    def submit(
        self,
        items: Sequence[tuple[str, str, str]],
        max_queued: int,
        *,
        ttl_s: float = 0.0,
        admit_memory_fraction: float = 0.8,
    ) -> None:
        """Enqueue (id, meta_json, payload_json) items atomically each; raise on the first refusal.

        Items before a refused one stay enqueued (they are valid and were accepted). A payload
        not run within `ttl_s` expires (0 = never). When Redis has a `maxmemory` and uses more
        than `admit_memory_fraction` of it, nothing is enqueued (AdmissionError): the rest is
        headroom for results and scheduling, which must never be refused.
        """
        self._admit_memory(admit_memory_fraction, len(items))
        ttl = str(int(ttl_s)) if ttl_s > 0 else "0"

        def send() -> list[Any]:
            pipe = self.r.pipeline(transaction=False)
            for action_id, meta, payload in items:
                self._submit(
                    keys=[INTAKE, akey(action_id)],
                    args=[action_id, meta, payload, max_queued, ttl, ""],
                    client=pipe,
                )
            return list(pipe.execute(raise_on_error=False))

        check_submitted(items, self.retrying("submit", send), max_queued)

    def _admit_memory(self, fraction: float, n: int) -> None:
        """AdmissionError when Redis is above `fraction` of its maxmemory (checked at most every
        0.25 s per Store: INFO is cheap but not free)."""
        now = time.monotonic()
        if now - self._mem_checked_s > 0.25:
            info = self.retrying("memory check", lambda: self.r.info("memory"))
            self._mem = (int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)))
            self._mem_checked_s = now
        why = memory_refusal(*self._mem, fraction, n)
        if why is not None:
            self._mem_checked_s = 0.0  # look again next time: it drains as actions finish
            raise AdmissionError(why)

    def control(self, fields: dict[str, str]) -> None:
        self.r.xadd(INTAKE, dict(fields.items()))

    def cancel(self, action_id: str, result_json: str) -> str:
        """Cancel an action that no scheduler has dispatched yet; 'cancelled' if it was, else
        its state ('dispatched', 'running', 'done', 'cancelled', or 'missing'), untouched."""
        return str(self._cancel(keys=cancel_keys(action_id), args=cancel_args(action_id, result_json)))

    def wait_result(self, action_id: str, timeout_s: float | None, poll_s: float = 2.0) -> str | None:
        """Block until the action's result exists; return its JSON, or None on timeout.

        The completion script stores the result in the action's hash (the truth) and pushes a
        copy onto `n:<id>` to wake the waiter. The push is consumed by whoever pops it, and a
        pop whose reply was lost (Redis died mid-reply) consumes it too, so the waiter never
        relies on it alone: every `poll_s` without a wake-up it reads the hash.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = poll_s if deadline is None else min(poll_s, deadline - time.monotonic())
            if left > 0:

                def pop(t: float = left) -> Any:
                    return self.r.blpop([nkey(action_id)], timeout=max(t, 0.001))

                got = self.retrying("wait for result", pop)
                if got is not None:
                    return str(got[1])
            res = self.retrying("wait for result", lambda: self.r.hget(akey(action_id), "result"))
            if res is not None:
                return str(res)
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def action_state(self, action_id: str) -> str | None:
        s = self.r.hget(akey(action_id), "state")
        return None if s is None else str(s)

    def published_config(self) -> dict[str, Any] | None:
        raw = self.r.get(CONFIG)
        return None if raw is None else json.loads(str(raw))

    def queued_count(self) -> int:
        return int(self.r.xlen(INTAKE))

    # ---- scheduler side --------------------------------------------------------------------
    def ensure_groups(self) -> None:
        for stream in (INTAKE, EVENTS):
            try:
                self.r.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def publish_config(self, view: dict[str, Any]) -> None:
        self.r.set(CONFIG, json.dumps(view))

    def read(self, count: int, block_ms: int | None) -> tuple[list[IntakeEntry], list[IntakeEntry]]:
        """Read new intake and events (one blocking call over both streams)."""
        resp: Any = self.r.xreadgroup(
            GROUP, CONSUMER, {EVENTS: ">", INTAKE: ">"}, count=count, block=block_ms
        )
        intake: list[IntakeEntry] = []
        events: list[IntakeEntry] = []
        for stream, entries in resp or []:
            target = intake if stream == INTAKE else events
            target.extend(IntakeEntry(sid, fields) for sid, fields in entries)
        return intake, events

    def read_pending(self, stream: str, count: int = 10_000) -> Iterator[list[IntakeEntry]]:
        """This consumer's delivered but unacknowledged entries of `stream`, in order, in pages."""
        after = "0"
        while True:
            resp: Any = self.r.xreadgroup(GROUP, CONSUMER, {stream: after}, count=count)
            entries = [IntakeEntry(sid, fields) for _, page in resp or [] for sid, fields in page]
            if not entries:
                return
            yield entries
            after = entries[-1].stream_id

    def ack(self, stream: str, ids: Iterable[str]) -> None:
        ids = list(ids)
        if ids:
            pipe = self.r.pipeline(transaction=False)
            pipe.xack(stream, GROUP, *ids)
            pipe.xdel(stream, *ids)
            pipe.execute()

    def load_running(self) -> dict[str, dict[str, Any]]:
        return {str(k): json.loads(v) for k, v in self.r.hgetall(RUNNING).items()}

    def load_pins(self) -> dict[str, dict[str, Any]]:
        return {str(k): json.loads(v) for k, v in self.r.hgetall(TRAJ).items()}

    def states(self, action_ids: Sequence[str]) -> list[str | None]:
        pipe = self.r.pipeline(transaction=False)
        for a in action_ids:
            pipe.hget(akey(a), "state")
        return list(pipe.execute())

    def mark_dispatched(
        self,
        records: Sequence[tuple[str, dict[str, Any]]],
        pins: dict[str, dict[str, Any]],
        intake_ids: Sequence[str],
        now_s: float,
        *,
        forget_pins: Sequence[str] = (),
        resets: dict[str, float] | None = None,
        resets_done: Sequence[str] = (),
    ) -> list[str]:
        """Persist allocations and take their entries off the intake, in one atomic script.

        `records` are (action id, {"alloc", "meta", "attempt", "sandbox"}); `pins` are pin
        records to write, `forget_pins` pins to delete (evicted trajectories), `resets` and
        `resets_done` trajectories to mark reset and to unmark (`update_pins`). Returns the ids
        it skipped because they are no longer queued (cancelled after the policy chose them):
        their messages must not be sent.

        This happens before the Celery messages are sent; a scheduler that dies in between
        re-sends every action still in state `dispatched` when it restarts (the worker's claim
        makes a duplicate message harmless).
        """
        args: list[Any] = [GROUP, repr(now_s), len(records)]
        for action_id, rec in records:
            args += [action_id, json.dumps(rec), rec["attempt"]]
        args.append(len(pins))
        for tid, pin in pins.items():
            args += [tid, json.dumps(pin)]
        args.append(len(forget_pins))
        args += list(forget_pins)
        resets = resets or {}
        args.append(len(resets))
        for tid, at in resets.items():
            args += [tid, repr(at)]
        args.append(len(resets_done))
        args += list(resets_done)
        args += list(intake_ids)
        keys = [RUNNING, TRAJ, INTAKE, RESETS, *(akey(a) for a, _ in records)]
        return [str(a) for a in self._dispatch(keys=keys, args=args)]

    def dead_letter(self, stream_id: str, fields: dict[str, str], why: str) -> None:
        """Keep a malformed intake entry for inspection (`XRANGE tangram:dead - +`), bounded."""
        entry: dict[Any, Any] = dict(fields)
        entry.update(intake_id=stream_id, reason=why)
        self.r.xadd(DEAD, entry, maxlen=DEAD_MAXLEN, approximate=True)

    def forget_running(self, action_ids: Sequence[str]) -> None:
        if action_ids:
            self.r.hdel(RUNNING, *action_ids)

    def forget_pin(self, trajectory_id: str) -> None:
        self.r.hdel(TRAJ, trajectory_id)

    def update_pins(
        self,
        pins: dict[str, dict[str, Any]],
        forget: Sequence[str] = (),
        resets: dict[str, float] | None = None,
        resets_done: Sequence[str] = (),
    ) -> None:
        """Write and delete pin records, mark trajectories reset (their sandbox was lost) and
        unmark them, in one round trip."""
        if pins or forget or resets or resets_done:
            pipe = self.r.pipeline(transaction=True)
            self._pin_updates(pipe, pins, forget, resets or {}, resets_done)
            pipe.execute()

    @staticmethod
    def _pin_updates(
        pipe: Any,
        pins: dict[str, dict[str, Any]],
        forget: Sequence[str],
        resets: dict[str, float],
        resets_done: Sequence[str],
    ) -> None:
        for tid, pin in pins.items():
            pipe.hset(TRAJ, tid, json.dumps(pin))
        if forget:
            pipe.hdel(TRAJ, *forget)
        if resets:
            pipe.hset(RESETS, mapping={t: repr(at) for t, at in resets.items()})
        if resets_done:
            pipe.hdel(RESETS, *resets_done)

    def load_resets(self) -> dict[str, float]:
        return {str(k): float(v) for k, v in self.r.hgetall(RESETS).items()}

    def report_sandboxes(self, worker: str, seq: int, held: Sequence[tuple[str, str]]) -> None:
        """A CPU worker's report of the sandboxes it holds, at its completion counter `seq`."""
        self.r.hset(SANDBOXES, worker, json.dumps({"seq": seq, "held": [list(h) for h in held]}))

    def sandbox_reports(self) -> dict[str, dict[str, Any]]:
        return {str(k): json.loads(v) for k, v in self.r.hgetall(SANDBOXES).items()}

    # ---- worker side -----------------------------------------------------------------------
    def claim(self, action_id: str, attempt: int, worker: str, now_s: float) -> tuple[str, str, float] | str:
        """dispatched -> running for `attempt`. Returns (meta, payload, dispatched_s) or why not."""
        rep = self.retrying(
            "claim", lambda: self._claim(keys=[akey(action_id)], args=[worker, repr(now_s), str(attempt)])
        )
        if isinstance(rep, list):
            return str(rep[0]), str(rep[1]), float(rep[2] or 0.0)
        return str(rep)

    def complete(self, action_id: str, result_json: str, event: dict[str, Any]) -> bool:
        """Store the result, wake the client, emit the release event. False if already done."""
        ev = json.dumps(event)
        rep = self.retrying(
            "complete",
            lambda: self._complete(
                keys=[akey(action_id), nkey(action_id), EVENTS],
                args=[action_id, result_json, ev, RESULT_TTL_S],
            ),
        )
        return bool(rep)

    def publish_residency(self, node: str, resident: dict[str, list[str]]) -> None:
        """Tell the scheduler which models GPU `node` holds on which chunks ("0,1" -> models),
        outside any action's completion (after a warm-up load). It goes on the events stream,
        so it is ordered with the completions that carry the same map."""
        event = json.dumps({"type": "residency", "pool": node, "resident": resident})
        self.retrying("residency", lambda: self.r.xadd(EVENTS, {"id": "", "event": event}))

    def set_warm_status(self, node: str, status: dict[str, Any] | None) -> None:
        """Record GPU `node`'s warm-up status; None forgets it (a new deployment starts)."""
        if status is None:
            self.retrying("warm status", lambda: self.r.hdel(WARM, node))
        else:
            self.retrying("warm status", lambda: self.r.hset(WARM, node, json.dumps(status)))

    def warm_status(self) -> dict[str, dict[str, Any]]:
        """GPU node -> its warm-up status ({'state': 'warming' | 'done', ...})."""
        return {str(k): json.loads(v) for k, v in self.r.hgetall(WARM).items()}

    def heartbeat(self, worker: str, pool_key: str) -> None:
        self._heartbeat(keys=[WORKERS, WORKER_POOLS], args=[worker, pool_key])

    def workers(self) -> tuple[float, dict[str, tuple[float, str]]]:
        """(Redis server time, {worker: (last heartbeat, pool key)})."""
        pipe = self.r.pipeline(transaction=False)
        pipe.time()
        pipe.hgetall(WORKERS)
        pipe.hgetall(WORKER_POOLS)
        (sec, usec), beats, pools = pipe.execute()
        now = float(sec) + float(usec) / 1e6
        return now, {str(w): (float(t), str(pools.get(w, ""))) for w, t in beats.items()}

    def forget_worker(self, worker: str) -> None:
        self.r.hdel(WORKERS, worker)
        self.r.hdel(WORKER_POOLS, worker)
        self.r.hdel(SANDBOXES, worker)

    def owners(self, action_ids: Sequence[str]) -> list[tuple[str | None, str | None, int, float]]:
        """(state, worker, attempt, dispatched_s) of each action."""
        pipe = self.r.pipeline(transaction=False)
        for a in action_ids:
            pipe.hmget(akey(a), "state", "worker", "attempt", "dispatched_s")
        return [(s, w, int(n or 0), float(d or 0.0)) for s, w, n, d in pipe.execute()]

    def requeue(self, action_id: str, worker: str, to_state: str, attempt: int, now_s: float) -> bool:
        """Take an action back from a worker presumed dead (or a pool that is gone)."""
        return bool(self._requeue(keys=[akey(action_id)], args=[worker, to_state, str(attempt), repr(now_s)]))

    def give_back(self, action_id: str, worker: str, attempt: int, event: dict[str, Any]) -> bool:
        """Hand a running action back to the scheduler to place again (no result for the client).
        False if this worker's attempt no longer owns it."""
        ev = json.dumps(event)
        return bool(
            self.retrying(
                "give_back",
                lambda: self._give_back(
                    keys=[akey(action_id), EVENTS], args=[worker, str(attempt), action_id, ev]
                ),
            )
        )

    def finish_unrun(self, action_id: str, result_json: str, trajectory_id: str) -> None:
        """Final result for an action the scheduler refused or gave up on (no worker ran it)."""
        self.complete(action_id, result_json, {"status": "unrun", "trajectory_id": trajectory_id})


def memory_refusal(used_b: int, max_b: int, fraction: float, n: int) -> str | None:
    """Why nothing may be enqueued while Redis uses `used_b` of its `max_b` maxmemory (None: fine)."""
    if max_b > 0 and used_b > fraction * max_b:
        return (
            f"broker full: Redis uses {used_b >> 20} MiB of its {max_b >> 20} MiB maxmemory "
            f"(admission stops at {fraction:.0%}); none of these {n} action(s) were enqueued, "
            "retry later or raise broker.maxmemory_mb"
        )
    return None


def check_submitted(items: Sequence[tuple[str, str, str]], replies: Sequence[Any], max_queued: int) -> None:
    """Raise for the first item the submit script refused (the ones before it were enqueued)."""
    for n, ((action_id, _, _), rep) in enumerate(zip(items, replies, strict=True)):
        if isinstance(rep, redis.ResponseError):
            msg = str(rep)
            if "TANGRAM_FULL" in msg:
                raise AdmissionError(
                    f"intake is full ({max_queued} actions waiting): the first {n} of this "
                    f"batch were enqueued, action {action_id} and the rest were not; retry "
                    "them later or raise scheduler.max_queued"
                )
            if "TANGRAM_DUPLICATE" in msg:
                raise ActionRejected(f"action id {action_id!r} was already submitted")
            if msg.startswith("OOM"):
                raise AdmissionError(
                    f"broker full (Redis maxmemory reached): the first {n} of this batch were "
                    f"enqueued, action {action_id} and the rest were not; retry them later"
                )
            raise BrokerError(f"submit of {action_id} failed: {msg}")
        if isinstance(rep, Exception):
            raise BrokerError(f"submit of {action_id} failed: {rep}")


def cancel_keys(action_id: str) -> list[str]:
    return [akey(action_id), nkey(action_id), EVENTS, INTAKE]


def cancel_args(action_id: str, result_json: str) -> list[Any]:
    return [action_id, result_json, json.dumps({"status": "cancelled"}), RESULT_TTL_S, GROUP]


def redact(url: str) -> str:
    """The URL with its password hidden, for logs and errors."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url
