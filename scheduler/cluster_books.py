"""The fields of a `ClusterState` and the indexes kept over them (`scheduler.resources`).

`ClusterBooks` holds the pools and the bookkeeping that ties allocations to them: who runs
where, which trajectory is pinned to which node, and the indexes by pool and by trajectory.
It updates only those indexes; placing and releasing units is `ClusterState`'s (a subclass),
saving and rebuilding the books `scheduler.snapshot`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.gpu_cache import GpuCache
from scheduler.model import Allocation, ResourceKind
from scheduler.pools import ApiPool, CpuNode, GpuNode, numa_shape


@dataclass
class ClusterBooks:
    """All pools plus the bookkeeping that ties allocations to them."""

    cpu: dict[str, CpuNode] = field(default_factory=dict)
    gpu: dict[str, GpuNode] = field(default_factory=dict)
    api: dict[str, ApiPool] = field(default_factory=dict)
    # trajectory -> CPU node it is pinned to (sticky after its first action)
    trajectory_node: dict[str, str] = field(default_factory=dict)
    running: dict[str, Allocation] = field(default_factory=dict)
    # action -> expected end time (s), recorded by `apply` from the action's duration estimate;
    # policies use it to estimate when units come back (the completion heap of Algorithm 2).
    expected_end_s: dict[str, float] = field(default_factory=dict)
    # actions sharing a GPU chunk allocated to another action of the same model (`share`)
    shared: set[str] = field(default_factory=set)
    # Which trajectories are busy, for eviction (memory is a cache): running action -> its
    # trajectory, and trajectory -> number of its running actions (any kind); kept by
    # apply/share/release.
    running_trajectory: dict[str, str] = field(default_factory=dict)
    trajectory_running: dict[str, int] = field(default_factory=dict)
    # pinned trajectory -> when one of its actions last started or ended (s): least recently
    # used idle trajectories are evicted first
    trajectory_used_s: dict[str, float] = field(default_factory=dict)
    # index of `running` per (kind, pool, NUMA group; 0 but for CPU), in start order; kept by
    # apply/share/release/restore
    by_pool: dict[tuple[ResourceKind, str, int], dict[str, Allocation]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # For indexes of the queue by pinned node (`scheduler.queue.WaitingQueue`): pins are added
    # (by `apply`, logged in `pin_log`, or directly, unlogged), removed by `close_trajectory`
    # (logged: the trajectories unpinned), and replaced by `restore` (`pin_epoch` + 1); a pin is
    # never overwritten in place. Each log drops its oldest entries now and then, counted in its
    # `_base`.
    pin_epoch: int = field(default=0, init=False, repr=False, compare=False)
    unpin_log: list[str] = field(default_factory=list, init=False, repr=False, compare=False)
    unpin_base: int = field(default=0, init=False, repr=False, compare=False)
    pin_log: list[str] = field(default_factory=list, init=False, repr=False, compare=False)
    pin_base: int = field(default=0, init=False, repr=False, compare=False)
    # Pools with no live worker ("cpu:<node>", "gpu:<node>"): nothing is placed there, and units
    # released there stay out of placement until the pool is back (`set_offline`).
    offline: set[str] = field(default_factory=set, init=False, repr=False, compare=False)
    # GPU node -> its resident services with their last use, for eviction on execution
    # (`attach_gpu_caches`; each `GpuNode.resident` is its cache's map). Not copied by `copy`:
    # policies read `GpuNode.resident` only.
    gpu_cache: dict[str, GpuCache] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for alloc in self.running.values():
            self._track(alloc)

    def pool_key(self, alloc: Allocation) -> tuple[ResourceKind, str, int]:
        """The pool `alloc` draws from: (kind, node or pool name, NUMA group of its first core;
        0 but for CPU)."""
        group = 0
        if alloc.kind is ResourceKind.CPU and alloc.unit_ids:
            node = self.cpu.get(alloc.pool)
            if node is not None:
                group = numa_shape(node.numa).group_of[alloc.unit_ids[0]]
        return (alloc.kind, alloc.pool, group)

    def _track(self, alloc: Allocation) -> None:
        if alloc.kind is ResourceKind.CPU and alloc.pool in self.cpu:
            self.cpu[alloc.pool].version += 1
        key = self.pool_key(alloc)
        on_pool = self.by_pool.get(key)
        if on_pool is None:
            self.by_pool[key] = on_pool = {}
        on_pool[alloc.action_id] = alloc

    def running_in(self, kind: ResourceKind, pool: str, group: int = 0) -> dict[str, Allocation]:
        """The running allocations of one pool (a CPU node's NUMA group, a GPU node), in start
        order (action id -> allocation)."""
        return self.by_pool.get((kind, pool, group), {})

    def _busy(self, action_id: str, tid: str) -> None:
        self.running_trajectory[action_id] = tid
        self.trajectory_running[tid] = self.trajectory_running.get(tid, 0) + 1

    def pin(self, trajectory_id: str, node: str) -> None:
        """Pin a trajectory that has no pin to `node`, logged for the queue's index."""
        self.trajectory_node[trajectory_id] = node
        self.pin_base = _log(self.pin_log, self.pin_base, trajectory_id)

    def close_trajectory(self, trajectory_id: str, keep_layer: bool = False) -> None:
        """Forget a finished (or evicted) trajectory: its node pin and its reserved memory.

        An image trajectory evicted for memory (`keep_layer`) keeps its copy-on-write layer on
        its node's image store; a finished one leaves no layer anywhere."""
        node = self.trajectory_node.pop(trajectory_id, None)
        self.trajectory_used_s.pop(trajectory_id, None)
        if node is not None:
            self.unpin_base = _log(self.unpin_log, self.unpin_base, trajectory_id)
        cpu = self.cpu.get(node) if node is not None else None
        if cpu is not None:
            cpu.trajectory_memory_mb.pop(trajectory_id, None)
            store = cpu.store
            if store is not None and trajectory_id in store.users:
                ref = store.users.pop(trajectory_id)
                if keep_layer:
                    store.layers[trajectory_id] = ref
        if not keep_layer:
            for n in self.cpu.values():
                if n.store is not None and n.store.layers:
                    n.store.layers.pop(trajectory_id, None)


def _log(log: list[str], base: int, trajectory_id: str) -> int:
    """Append to a pin or unpin log, dropping its entries first when it holds 1024; its base
    afterwards (how many entries were ever dropped)."""
    if len(log) >= 1024:
        base += len(log)
        log.clear()
    log.append(trajectory_id)
    return base
