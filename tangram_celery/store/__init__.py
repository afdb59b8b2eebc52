"""Tangram's state in Redis: one interface for everything the client, scheduler and workers share.

Keys (all under `tangram:`):
  intake            stream of submitted action metadata and control messages (close, cancel)
                    of the default tenant (group `sched`); its length is the number of actions
                    not yet dispatched (entries are deleted on dispatch), which bounds the intake
  limits            hash the scheduler writes, a tenant's submits read: `max_queued`
  memory            "<used> <maxmemory>" bytes of Redis, published by the scheduler every second
                    (clients' memory admission without INFO)
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
  nodes             hash node -> its membership record (kind, state, capacity; `node_side.py`)
  node_load         hash node -> its load as the scheduler sees it (units in use, running, pinned)
  languages         hash CPU node -> the languages its sandboxes run (JSON list), set by its
                    worker at start; clients refuse code actions in any other language
  tenants           hash tenant name -> its record (quotas, HTTP token digest; `tenant_side.py`)
  t:<name>:...      a tenant's own intake, limits, a:, n:, nq: keys (`common.tenants.prefix`);
                    the `default` tenant's are the keys above. Between processes its ids are
                    qualified, `<name>/<id>` (`akey` and `nkey` map them into its prefix)

Action states: queued -> dispatched -> running -> done, and queued -> cancelled (only an action
that was never dispatched; see `cancel`). Transitions happen only in the Lua scripts
(`scripts.py`), so a duplicate Celery message can never run an action twice and a cancelled
action never runs. The operations of the client, the scheduler and the workers are each in
their own module (`client_side.py`, `scheduler_side.py`, `worker_side.py`); what they write is
typed by `tangram_celery.common.wire`. The client side is built without I/O in `client_ops.py`
(commands as values, `calls.py`) and carried out by two executors: the blocking `Store` and the
asyncio `AsyncStore` (`client_aio.py`).
"""

from __future__ import annotations

from tangram_celery.store.client_ops import (
    SubmitBatch,
    cancel_args,
    cancel_keys,
    check_submitted,
    languages_of,
    memory_refusal,
)
from tangram_celery.store.client_side import ClientSide
from tangram_celery.store.keys import (
    CONFIG,
    CONSUMER,
    DEAD,
    DEAD_MAXLEN,
    EVENTS,
    GROUP,
    INTAKE,
    LANGS,
    MEMORY,
    READ_TTL_S,
    RESETS,
    RESULT_TTL_S,
    RUNNING,
    SANDBOXES,
    TRAJ,
    WARM,
    WORKER_POOLS,
    WORKERS,
    ActionState,
    IntakeEntry,
    akey,
    intake_key,
    limits_key,
    nkey,
    notify_key,
    redact,
)
from tangram_celery.store.node_side import NodeSide
from tangram_celery.store.scheduler_side import SchedulerSide
from tangram_celery.store.scripts import CANCEL, SUBMIT
from tangram_celery.store.tenant_side import TenantSide
from tangram_celery.store.worker_side import WorkerSide


class Store(ClientSide, SchedulerSide, WorkerSide, NodeSide, TenantSide):
    """One interface over one Redis connection pool for everything the client, the scheduler
    and the workers share; each side's operations are in its own module."""


__all__ = [
    "CANCEL",
    "CONFIG",
    "CONSUMER",
    "DEAD",
    "DEAD_MAXLEN",
    "EVENTS",
    "GROUP",
    "INTAKE",
    "LANGS",
    "MEMORY",
    "READ_TTL_S",
    "RESETS",
    "RESULT_TTL_S",
    "RUNNING",
    "SANDBOXES",
    "SUBMIT",
    "TRAJ",
    "WARM",
    "WORKERS",
    "WORKER_POOLS",
    "ActionState",
    "IntakeEntry",
    "Store",
    "SubmitBatch",
    "akey",
    "cancel_args",
    "cancel_keys",
    "check_submitted",
    "intake_key",
    "languages_of",
    "limits_key",
    "memory_refusal",
    "nkey",
    "notify_key",
    "redact",
]
