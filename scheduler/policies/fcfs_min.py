"""`fcfs-min`: start the longest FCFS prefix that fits, every action at its minimum units."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from scheduler.eviction import Evictions, drain, place_evicting
from scheduler.execution import TANGRAM
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies.base import register
from scheduler.resources import ClusterState


def fcfs_prefix(
    queue: Sequence[QueuedAction],
    state: ClusterState,
    now_s: float,
    units_of: Callable[[QueuedAction], int] | None = None,
    everything: Sequence[QueuedAction] | None = None,
) -> tuple[list[Allocation], ClusterState]:
    """Allocate actions at minimum units (or `units_of`) in FCFS order until one does not fit.

    The prefix is taken per key-resource pool family: an action waiting for a busy API does not
    block CPU actions behind it, but within one family order is strict (no overtaking), with
    one exception: an action that needs memory no node can give it (a new trajectory, or a
    pinned one asking for more than it holds) blocks only the actions behind it that need
    memory too, and its trajectory's later actions, since the others need none and are what
    frees it. Before it waits, idle trajectories are evicted to make room (`scheduler.eviction`).
    `everything` is the whole waiting queue when `queue` is a part of it (which trajectories
    are idle is decided on the whole queue). Returns the allocations and the state with them
    applied.
    """
    work = state.copy()
    out: list[Allocation] = []
    blocked: set[tuple[str, str]] = set()
    no_memory = False
    waiting_for_memory: set[str] = set()  # trajectories whose earlier action waits for memory
    ev: Evictions | None = None
    cpu = ResourceKind.CPU
    for action in queue:
        family = (str(action.cost.key), action.target)
        if family in blocked:
            continue
        sandboxed = action.cost.key is cpu and action.cost.sandbox
        if sandboxed and waiting_for_memory and action.trajectory_id in waiting_for_memory:
            continue
        needs_memory = sandboxed and (
            action.trajectory_id not in work.trajectory_node or work.memory_extra_mb(action) > 0
        )
        if no_memory and needs_memory:
            waiting_for_memory.add(action.trajectory_id)
            continue
        units = action.cost.units.min if units_of is None else units_of(action)
        alloc = work.place(action, units, now_s)
        if alloc is None and needs_memory:
            if ev is None:
                ev = Evictions(state, queue if everything is None else everything)
            alloc = place_evicting(work, action, units, ev)
        if alloc is None:
            if needs_memory and work.lacks_memory(action):
                no_memory = True
                waiting_for_memory.add(action.trajectory_id)
            else:
                blocked.add(family)
            continue
        work.apply(alloc, action, now_s)
        if alloc.evict:
            assert ev is not None
            ev.take(alloc.evict)
            drain(work, alloc)
        out.append(alloc)
    return out, work


@register("fcfs-min")
class FcfsMin:
    name = "fcfs-min"
    execution = TANGRAM

    def decide(self, queue: Sequence[QueuedAction], state: ClusterState, now_s: float) -> list[Allocation]:
        return fcfs_prefix(queue, state, now_s)[0]
