"""CPU memory is a cache, not a lease: evicting idle trajectories to place an action.

The paper reserves a trajectory's sandbox memory for the trajectory's whole life. Callers that
never close their trajectories (every SandboxFusion-style client) then hold all of a node's
memory with sandboxes nobody uses, and new trajectories wait for the idle TTL while cores sit
free. Here an idle trajectory's warm sandbox is a cached copy: when an action cannot be placed
for lack of memory, the least recently used *idle* trajectories on a node with the cores it
needs (pinned there, no action running, none queued) are evicted: their reservations are
released and their sandboxes removed, exactly as GPU services are evicted on execution. The
evicting allocation names them (`Allocation.evict`); `ClusterState.apply` releases them, and
the executor removes their sandboxes. A later action of an evicted trajectory starts over in a
fresh sandbox, and its result says so.

Within one round, memory freed by an eviction goes to the action that evicted; whatever is left
over counts as free only from the next round on. So no other decision of the round depends on
an eviction that the elastic round may still drop with its candidate (drop-tail), and every
policy computes the same thing (`fcfs_prefix` on a copied state, `tangram-fast`'s one pass on
plain counters).
"""

from __future__ import annotations

from collections.abc import Collection, Container, Sequence

from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState, CpuNode

DRAINED = "\0drained:"  # prefix of the placeholder reservation that holds an eviction's surplus


def queued_trajectories(queue: Sequence[QueuedAction]) -> Collection[str]:
    """The trajectories with at least one queued action (never evicted: they are not idle)."""
    if isinstance(queue, WaitingQueue):
        return queue.trajectories()
    return {a.trajectory_id for a in queue}


class Evictions:
    """What one round may still evict, per node, least recently used first.

    Built on the state the policy was given (not a working copy), and only when a round first
    lacks memory: rounds of a deployment that never runs short never build one.
    """

    def __init__(self, state: ClusterState, queue: Sequence[QueuedAction]) -> None:
        self.state = state
        self._queue = queue
        self._busy: Container[str] | None = None
        self._idle: dict[str, list[str]] = {}
        self.taken: set[str] = set()

    def victims(self, node: str, short_mb: int) -> tuple[str, ...] | None:
        """Least recently used idle trajectories on `node`, not taken earlier this round, whose
        reservations add up to at least `short_mb` MiB; None when all of them would not do."""
        if short_mb <= 0:
            return ()
        idle = self._idle.get(node)
        if idle is None:
            if self._busy is None:
                self._busy = queued_trajectories(self._queue)
            idle = self._idle[node] = self.state.idle_trajectories(node, self._busy)
        held = self.state.cpu[node].trajectory_memory_mb
        out: list[str] = []
        got = 0
        for tid in idle:
            if tid in self.taken:
                continue
            out.append(tid)
            got += held[tid]
            if got >= short_mb:
                return tuple(out)
        return None

    def take(self, victims: tuple[str, ...]) -> None:
        self.taken.update(victims)


def place_evicting(work: ClusterState, action: QueuedAction, units: int, ev: Evictions) -> Allocation | None:
    """An allocation of `units` cores for a CPU action that `ClusterState.place` could not place
    for lack of memory, evicting idle trajectories; None when no node can take it that way.

    A pinned trajectory stays on its node (evicting for the increase it asks for); a new one
    goes to the node with the most free memory among those with the cores and enough idle
    trajectories. `work` is the round's working copy (it has this round's placements).
    """
    if action.cost.key is not ResourceKind.CPU or not action.cost.sandbox:
        return None
    need = work.memory_extra_mb(action)
    if need <= 0:
        return None
    pinned = work.trajectory_node.get(action.trajectory_id)
    nodes: list[CpuNode]
    if pinned is not None:
        node = work.cpu.get(pinned)
        nodes = [node] if node is not None else []
    else:
        nodes = sorted((n for n in work.cpu.values() if n.online), key=lambda n: (-n.memory_free_mb, n.name))
    for node in nodes:
        short_mb = need - node.memory_free_mb
        if short_mb <= 0 or node.max_block() < units:
            continue  # it has the memory: cores are what it lacks
        victims = ev.victims(node.name, short_mb)
        if victims is None:
            continue
        ids = node.pick(units)
        assert ids is not None
        return Allocation(action.action_id, ResourceKind.CPU, node.name, units, ids, victims)
    return None


def drain(work: ClusterState, alloc: Allocation) -> None:
    """After applying an evicting `alloc` to the round's working copy: hold what the eviction
    freed beyond the action's need, so that no later decision of the round relies on it."""
    node = work.cpu[alloc.pool]
    surplus = node.memory_free_mb
    if surplus > 0:
        node.trajectory_memory_mb[DRAINED + alloc.action_id] = surplus
