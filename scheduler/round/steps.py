"""The round's steps around the policy's decision: one action per sandbox, GPU batch riders,
and the GPU loads the allocations plan (`scheduler.round`)."""

from __future__ import annotations

from collections.abc import Callable

from scheduler.execution import GpuResidency
from scheduler.gpu_cache import GpuCache, GpuLoad
from scheduler.model import Allocation, ResourceKind
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState

MaxBatch = Callable[[str], int]  # GPU service -> largest batch one call scores


def one_per_sandbox(allocs: list[Allocation], queue: WaitingQueue, state: ClusterState) -> list[Allocation]:
    """`allocs` without the CPU allocations of a trajectory whose sandbox is taken: by a CPU
    action of it already running, or by an earlier allocation of the round. A trajectory's
    actions run in its one sandbox one at a time, so a second one would hold its cores idle
    until the first ends (and could reach the worker first). It waits, or rides behind the
    first (`cpu_batch`). Policies place actions as if they were independent; workloads of
    agents (and every simulated scenario) submit a trajectory's next action after the last one
    ended, so this only holds back callers that submit several of a trajectory's actions at
    once."""
    out: list[Allocation] = []
    taken: set[str] = set()
    for a in allocs:
        if a.kind is ResourceKind.CPU:
            qa = queue.action(a.action_id)
            tid = qa.trajectory_id
            if qa.cost.sandbox:
                if tid in taken or (tid in state.trajectory_running and _runs_code(state, tid)):
                    continue
                taken.add(tid)
        out.append(a)
    return out


def _runs_code(state: ClusterState, tid: str) -> bool:
    """Does trajectory `tid` have a CPU action running (only asked when it runs something)?"""
    return any(
        t == tid and state.running[aid].kind is ResourceKind.CPU
        for aid, t in state.running_trajectory.items()
    )


def riders(allocs: list[Allocation], queue: WaitingQueue, max_batch: MaxBatch) -> list[Allocation]:
    """Batch reward actions: each GPU allocation takes along up to `max_batch - 1` waiting
    actions of the same service that run at the same DoP, on the same chunk (FCFS among them).

    They need no units of their own: the worker scores them in one batch with the action the
    chunk was allocated to, which is what a GPU does best. Other waiting actions lose nothing,
    since no units are taken from them."""
    leaders = [a for a in allocs if a.kind is ResourceKind.GPU]
    if not leaders:
        return []
    started = {a.action_id for a in allocs}
    room: dict[str, list[Allocation]] = {}
    for a in leaders:
        service = queue.action(a.action_id).target
        n = max_batch(service)
        if n > 1:
            room.setdefault(service, []).extend([a] * (n - 1))
    if not room:
        return []
    out: list[Allocation] = []
    gpu = ResourceKind.GPU
    for qa in queue:
        seats = room.get(qa.target) if qa.cost.key is gpu else None
        if not seats or qa.action_id in started:
            continue
        for k, lead in enumerate(seats):
            if lead.units in qa.cost.units.units:
                del seats[k]
                out.append(Allocation(qa.action_id, gpu, lead.pool, lead.units, lead.unit_ids))
                break
    return out


def gpu_loads(
    allocs: list[Allocation], queue: WaitingQueue, state: ClusterState, now_s: float, residency: GpuResidency
) -> dict[str, GpuLoad]:
    """Each GPU allocation's load, planned in order on copies of the state's caches (a restore
    may evict what an earlier one of the round loaded). Under KEEPALIVE an instance in use is
    never evicted, as its executor marks it."""
    scratch: dict[str, GpuCache] = {}
    out: dict[str, GpuLoad] = {}
    for a in allocs:
        if a.kind is not ResourceKind.GPU or a.pool not in state.gpu_cache:
            continue
        cache = scratch.get(a.pool)
        if cache is None:
            cache = scratch[a.pool] = state.gpu_cache[a.pool].copy()
        try:
            load = cache.plan(a.pool, a.unit_ids, queue.action(a.action_id).target)
        except ValueError:
            continue  # it never fits there: left to its executor (which says so)
        cache.apply(load, now_s)
        if residency is GpuResidency.KEEPALIVE:
            cache.touch(a.unit_ids, load.service, float("inf"))
        out[a.action_id] = load
    return out
