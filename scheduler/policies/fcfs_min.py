"""`fcfs-min`: start the longest FCFS prefix that fits, every action at its minimum units."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies.base import register
from scheduler.resources import ClusterState


def fcfs_prefix(
    queue: Sequence[QueuedAction],
    state: ClusterState,
    now_s: float,
    units_of: Callable[[QueuedAction], int] | None = None,
) -> tuple[list[Allocation], ClusterState]:
    """Allocate actions at minimum units (or `units_of`) in FCFS order until one does not fit.

    The prefix is taken per key-resource pool family: an action waiting for a busy API does not
    block CPU actions behind it, but within one family order is strict (no overtaking), with
    one exception: a new trajectory that no node has the memory for blocks only the new
    trajectories behind it, since the pinned ones need no memory and are what frees it.
    Returns the allocations and the state with them applied.
    """
    work = state.copy()
    out: list[Allocation] = []
    blocked: set[tuple[str, str]] = set()
    no_memory = False
    for action in queue:
        family = (str(action.cost.key), action.target)
        if family in blocked:
            continue
        fresh = (
            action.cost.key is ResourceKind.CPU
            and action.cost.sandbox
            and action.trajectory_id not in work.trajectory_node
        )
        if no_memory and fresh:
            continue
        units = action.cost.units.min if units_of is None else units_of(action)
        alloc = work.place(action, units, now_s)
        if alloc is None:
            if fresh and work.lacks_memory(action):
                no_memory = True
            else:
                blocked.add(family)
            continue
        work.apply(alloc, action, now_s)
        out.append(alloc)
    return out, work


@register("fcfs-min")
class FcfsMin:
    name = "fcfs-min"

    def decide(self, queue: Sequence[QueuedAction], state: ClusterState, now_s: float) -> list[Allocation]:
        return fcfs_prefix(queue, state, now_s)[0]
