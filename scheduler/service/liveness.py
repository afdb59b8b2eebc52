"""Worker liveness: which pools are gone, which actions to retry, re-route or forget.

Workers heart-beat into Redis (server time). Every `check_every_s` the scheduler compares each
running action's owner with the live workers, and `assess` turns what it read into a
`LivenessPlan` (pure: no I/O, no clock of its own) that the loop carries out (`Faults.apply`):
- the owner stopped beating while the action ran -> the action is retried on the same pool
  (a new attempt; the old attempt's message can no longer claim it), at most `max_attempts`
  times, then it finishes with status `error`;
- every worker of a CPU/GPU pool stopped beating -> the pool is taken offline (no placements)
  and its actions, queued or running there, go back to the front of the waiting queue; their
  trajectories are unpinned and start over on another node. The pool comes back when a worker
  beats again.
- an action dispatched but not claimed within `claim_timeout_s` (its message died with a
  worker that had prefetched it, and sits unacknowledged in the broker) is sent again as a new
  attempt; when the old message resurfaces it is stale and cannot claim. When a worker of its
  pool that was alive at the dispatch (its last beat at most `dead_after_s` before it) has
  stopped beating since, that worker may have taken the message with it: the action goes
  again at once instead of after `claim_timeout_s` (a crashed CPU worker's batches, queued
  behind the one it ran, used to wait the whole timeout). A message that was still queued is
  taken by a live worker and found stale, as any superseded attempt.
- an action whose record is gone from Redis (expired, deleted by hand) is forgotten.
Failures of the user's code are results, never retried here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from scheduler.model import Allocation, ResourceKind

Owner = tuple[str | None, str | None, int, float]  # (state, worker, attempt, dispatched_s)


@dataclass(frozen=True)
class LivenessPolicy:
    dead_after_s: float = 5.0
    claim_timeout_s: float = 20.0
    max_attempts: int = 5
    check_every_s: float = 1.0
    forget_after_s: float = 3600.0


def pool_key(kind: ResourceKind, pool: str) -> str:
    return f"{kind}:{pool}"


@dataclass
class LivenessPlan:
    """What one liveness pass found, in the order to act on it.

    `offline`: the pools with known workers none of which is alive (all others are online);
    `alive`: the live workers; `forget`: workers silent for `forget_after_s`;
    `vanished`: running actions with no record left; `reroute` / `retry`: (action, worker,
    attempt) of actions on an offline pool / of a lost or never-claimed attempt (worker "")."""

    offline: set[str] = field(default_factory=set)
    alive: set[str] = field(default_factory=set)
    forget: list[str] = field(default_factory=list)
    vanished: list[str] = field(default_factory=list)
    reroute: list[tuple[str, str, int]] = field(default_factory=list)
    retry: list[tuple[str, str, int]] = field(default_factory=list)


def assess(
    policy: LivenessPolicy,
    server_now_s: float,
    workers: Mapping[str, tuple[float, str]],
    running: Mapping[str, Allocation],
    owners: Sequence[Owner],
    local_now_s: float,
    gone: AbstractSet[str] = frozenset(),
) -> LivenessPlan:
    """The plan for the workers' heartbeats `workers` (worker -> (last beat, pool key), Redis
    server time `server_now_s`) and the `owners` of the `running` actions (in its order).
    `gone`: pools of nodes that left (drained, `nodes.NodeBook`): offline whatever beats."""
    plan = LivenessPlan()
    plan.alive = {w for w, (t, _) in workers.items() if server_now_s - t <= policy.dead_after_s}
    plan.forget = [w for w, (t, _) in workers.items() if server_now_s - t > policy.forget_after_s]
    known = {p for _, p in workers.values()}
    alive_pools = {p for w, (_, p) in workers.items() if w in plan.alive} - gone
    plan.offline = (known - alive_pools) | set(gone)
    # per pool, the latest last beat of a worker that stopped beating (not yet forgotten), in
    # the scheduler's clock: an action dispatched before it (and up to `dead_after_s` after,
    # when the worker may still have lived) may have died with that worker's prefetch
    to_local = local_now_s - server_now_s
    lost_beat: dict[str, float] = {}
    for w, (t, p) in workers.items():
        if w not in plan.alive and server_now_s - t <= policy.forget_after_s:
            lost_beat[p] = max(lost_beat.get(p, float("-inf")), t + to_local)
    for (action_id, alloc), (state, worker, attempt, dispatched_s) in zip(
        running.items(), owners, strict=True
    ):
        if state is None:  # its record expired or was deleted: nothing will ever complete it
            plan.vanished.append(action_id)
            continue
        key = pool_key(alloc.kind, alloc.pool)
        if key in plan.offline and alloc.kind is not ResourceKind.API:
            plan.reroute.append((action_id, worker or "", attempt))
        elif state == "running" and worker not in plan.alive:
            plan.retry.append((action_id, worker or "", attempt))
        elif (
            state == "dispatched"
            and key in alive_pools
            and (
                local_now_s - dispatched_s > policy.claim_timeout_s
                or dispatched_s <= lost_beat.get(key, float("-inf")) + policy.dead_after_s
            )
        ):
            plan.retry.append((action_id, "", attempt))
    return plan
