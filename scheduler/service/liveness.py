"""Worker liveness: retry actions whose worker died, re-route actions of a pool that is gone.

Workers heart-beat into Redis (server time). Every `check_every_s` the scheduler compares each
running action's owner with the live workers:
- the owner stopped beating while the action ran -> the action is retried on the same pool
  (a new attempt; the old attempt's message can no longer claim it), at most `max_attempts`
  times, then it finishes with status `error`;
- every worker of a CPU/GPU pool stopped beating -> the pool is taken offline (no placements)
  and its actions, queued or running there, go back to the front of the waiting queue; their
  trajectories are unpinned and start over on another node. The pool comes back when a worker
  beats again.
- an action dispatched but not claimed within `claim_timeout_s` (its message died with a
  worker that had prefetched it, and sits unacknowledged in the broker) is sent again as a new
  attempt; when the old message resurfaces it is stale and cannot claim.
Failures of the user's code are results, never retried here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.model import ResourceKind

if TYPE_CHECKING:
    from scheduler.service.loop import SchedulerService

log = logging.getLogger("tangram.scheduler")


@dataclass(frozen=True)
class LivenessPolicy:
    dead_after_s: float = 5.0
    claim_timeout_s: float = 20.0
    max_attempts: int = 5
    check_every_s: float = 1.0
    forget_after_s: float = 3600.0


def pool_key(kind: ResourceKind, pool: str) -> str:
    return f"{kind}:{pool}"


def check(svc: SchedulerService, policy: LivenessPolicy) -> None:
    """One liveness pass over the workers and the running actions."""
    now, workers = svc.store.workers()
    alive = {w for w, (t, _) in workers.items() if now - t <= policy.dead_after_s}
    for w, (t, _) in workers.items():
        if now - t > policy.forget_after_s:
            svc.store.forget_worker(w)
    known = {p for _, p in workers.values()}
    alive_pools = {p for w, (_, p) in workers.items() if w in alive}
    svc.set_offline(known - alive_pools)
    svc.reconcile_sandboxes(alive, svc.store.sandbox_reports())
    ids = list(svc.state.running)
    if not ids:
        return
    local_now = svc.clock()
    for action_id, (state, worker, attempt, dispatched_s) in zip(ids, svc.store.owners(ids), strict=True):
        alloc = svc.state.running.get(action_id)
        if alloc is None:
            continue
        if state is None:  # its record expired or was deleted: nothing will ever complete it
            svc.forget_vanished(action_id)
            continue
        key = pool_key(alloc.kind, alloc.pool)
        if key in svc.offline and alloc.kind is not ResourceKind.API:
            svc.reroute(action_id, worker or "", attempt, policy.max_attempts)
        elif state == "running" and worker not in alive:
            svc.retry(action_id, worker or "", attempt, policy.max_attempts)
        elif (
            state == "dispatched" and key in alive_pools and local_now - dispatched_s > policy.claim_timeout_s
        ):
            svc.retry(action_id, "", attempt, policy.max_attempts)
