"""`tangram-fast`'s candidates: the FCFS prefix in one pass over the queue, with per-NUMA-group
free lists instead of placing each action on a copied `ClusterState` (`fast_candidates`).

Elastic actions go to the NUMA group with the most free cores (room to grow), rigid ones
best-fit. GPU calls go to `gpu_aware.gpu_candidates`, API calls to `fcfs_prefix`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from scheduler.eviction import Evictions
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies.common import PoolKey
from scheduler.policies.elastic import Known
from scheduler.policies.fcfs_min import fcfs_prefix
from scheduler.policies.gpu_aware import gpu_candidates
from scheduler.policies.image_places import ImagePlaces
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState


def fast_candidates(
    queue: Sequence[QueuedAction], state: ClusterState, now_s: float
) -> tuple[list[Allocation], Known]:
    """The same FCFS prefix as `fcfs_prefix`, with a cheap per-group view for CPU actions.

    Per-node views are built lazily (only nodes the scan touches), from the free cores only.
    Memory is counted per node as it is taken; an action that lacks it evicts idle
    trajectories as `fcfs_prefix` does (`scheduler.eviction`). Also returns each candidate's
    action, and its pool where the pass knows it (CPU).
    """
    cpu = _CpuPass(queue, state, now_s)
    gpu: list[QueuedAction] = []
    api: list[QueuedAction] = []
    blocked = False  # a CPU action did not fit: no CPU action behind it starts (FCFS)
    cpu_kind, gpu_kind = ResourceKind.CPU, ResourceKind.GPU
    walk = cpu.walk
    for action in walk:
        kind = action.cost.key
        if kind is not cpu_kind:
            (gpu if kind is gpu_kind else api).append(action)
            continue
        if not cpu.place(action):
            blocked = True
            break
    if blocked and (state.gpu or state.api):  # no CPU action passes it (FCFS); GPU and API
        tail = list(walk)  # ones behind it go on
        if state.gpu:
            gpu += [a for a in tail if a.cost.key is gpu_kind]
        if state.api:
            api += [a for a in tail if a.cost.key is not gpu_kind and a.cost.key is not cpu_kind]
    picked, pools, actions = cpu.picked, cpu.pools, cpu.actions
    # Families are independent, so CPU, then GPU, then API allocations apply in any order.
    others = (gpu_candidates(gpu, state, now_s) if gpu else []) + (
        fcfs_prefix(api, state, now_s)[0] if api else []
    )
    if others:
        by_id = {a.action_id: a for a in itertools.chain(gpu, api)}
        picked += others
        pools += [None] * len(others)
        actions += [by_id[a.action_id] for a in others]
    return picked, Known(actions, pools)


Spot = tuple[str | None, int, tuple[str, ...]]  # (node, NUMA group or -1, trajectories evicted)


class _CpuPass:
    """`fast_candidates`' CPU side: one pass's views of the free cores and memory, and what it
    picked. `place` takes the CPU actions in FCFS order."""

    def __init__(self, queue: Sequence[QueuedAction], state: ClusterState, now_s: float = 0.0) -> None:
        self.queue, self.state = queue, state
        self.groups = _LazyGroups(state)
        self.mem_free: dict[str, int] = {}
        self.pins: dict[str, str] = {}
        self.held_now: dict[str, int] = {}  # memory reserved this pass for trajectories it pinned or grew
        self.picked: list[Allocation] = []
        self.pools: list[PoolKey | None] = []
        self.actions: list[QueuedAction] = []
        self.no_memory = False
        self.waiting_for_memory: set[str] = set()  # trajectories whose earlier action waits for memory
        self.ev: Evictions | None = None
        self.walk = _Walk(queue, state)
        self.images = ImagePlaces(state, now_s)

    def place(self, action: QueuedAction) -> bool:
        """Pick cores for CPU `action`, or let it wait; False when it does not fit (no CPU
        action behind it starts, FCFS)."""
        options = action.cost.units.units
        units = options[0]
        elastic = len(options) > 1
        tid = action.trajectory_id
        sandbox = action.cost.sandbox
        if sandbox and self.waiting_for_memory and tid in self.waiting_for_memory:
            return True
        node = (self.state.trajectory_node.get(tid) or self.pins.get(tid)) if sandbox else None
        spot: Spot | None
        if node is not None:
            spot = self._pinned(action, node, units, elastic)
        elif self.no_memory and sandbox:
            return True  # a new trajectory before it waits for memory: no overtaking among new ones
        else:
            spot = self._new(action, units, elastic)
        if spot is None:
            return True  # it waits for memory, the others go on
        node, gi, evict = spot
        if gi < 0 or node is None:
            return False
        free = self.groups[node][gi]
        ids = tuple(free[:units])
        del free[:units]
        self.picked.append(Allocation(action.action_id, ResourceKind.CPU, node, units, ids, evict))
        self.pools.append(("cpu", node, gi))
        self.actions.append(action)
        return True

    def _mem_free(self) -> dict[str, int]:
        mem_free = self.mem_free
        if not mem_free:
            mem_free.update({n: c.memory_free_mb for n, c in self.state.cpu.items() if c.online})
        return mem_free

    def _evictions(self) -> Evictions:
        if self.ev is None:
            self.ev = Evictions(self.state, self.queue)
        return self.ev

    def _pinned(self, action: QueuedAction, node: str, units: int, elastic: bool) -> Spot | None:
        """Where an action of a trajectory pinned to `node` goes (None: it waits for memory)."""
        state, tid, sandbox = self.state, action.trajectory_id, action.cost.sandbox
        gi = _best_group(self.groups[node], units, elastic) if node in state.cpu else -1
        evict: tuple[str, ...] = ()
        held = self.held_now.get(tid)
        if held is None and node in state.cpu:
            held = state.cpu[node].trajectory_memory_mb.get(tid, 0)
        extra = action.cost.memory_mb - held if sandbox and held is not None else 0
        if extra > 0:  # a later action asks for more memory than its trajectory holds
            if self.no_memory:
                self.waiting_for_memory.add(tid)
                return None
            mem_free = self._mem_free()
            free_mb = mem_free.get(node, 0)
            if free_mb < extra:
                ev = self._evictions()
                victims = ev.victims(node, extra - free_mb) if gi >= 0 else None
                if victims is None:
                    self.no_memory = True  # as for a new trajectory: the others go on
                    self.waiting_for_memory.add(tid)
                    self.walk.memory_full(action, self.pins)
                    return None
                evict = victims
                ev.take(victims)
                mem_free[node] = 0  # the surplus is free from the next round on
            elif gi >= 0:
                mem_free[node] = free_mb - extra
            self.held_now[tid] = action.cost.memory_mb
        return node, gi, evict

    def _new(self, action: QueuedAction, units: int, elastic: bool) -> Spot | None:
        """Where an action of a new trajectory (or one without a sandbox) goes: the node with
        the most free memory that has the cores, evicting there when none has the memory
        (None: it waits for memory)."""
        sandbox, groups = action.cost.sandbox, self.groups
        mem_free = self._mem_free()
        node: str | None = None
        gi = -1
        evict: tuple[str, ...] = ()
        need = action.cost.memory_mb if sandbox else 0
        order = mem_free if len(mem_free) == 1 else sorted(mem_free, key=lambda n: (-mem_free[n], n))
        if sandbox and action.image:  # the node where it starts soonest (`image_places`)
            on_layer = self._on_layer(action, units, elastic, need)
            if on_layer is not None:
                return on_layer
            order = self.images.order(action, order)
        for name in order:
            if mem_free[name] < need:
                if action.image:
                    continue  # not sorted by memory
                break
            gi = _best_group(groups[name], units, elastic)
            if gi >= 0:
                if action.image and sandbox and self.images.waits(action, name):
                    return None  # its image is sooner where cores come back: it waits there
                node = name
                self._take(action, name, need, evicted=False)
                break
        if node is None and sandbox and need > 0:
            ev = self._evictions()
            for name in order:  # the nodes with the cores, most free memory first
                short_mb = need - mem_free[name]
                if short_mb <= 0:
                    continue  # it has the memory: cores are what it lacks
                g = _best_group(groups[name], units, elastic)
                victims = ev.victims(name, short_mb) if g >= 0 else None
                if victims is not None and action.image and self.images.waits(action, name):
                    return None  # as above: it waits where its image or layer is
                if victims is not None:
                    node, gi, evict = name, g, victims
                    ev.take(victims)
                    self._take(action, name, need, evicted=True)
                    break
        if node is None and max(mem_free.values(), default=0) < need:
            self.no_memory = True  # see `fcfs_prefix`: pinned trajectories behind it go on
            self.walk.memory_full(action, self.pins)
            return None
        return node, gi, evict

    def _on_layer(self, action: QueuedAction, units: int, elastic: bool, need: int) -> Spot | None:
        """An evicted image trajectory resumes on the node that keeps its layer (its files
        intact, no fetch) when that node has the cores, evicting idle trajectories there for
        memory if it must, rather than starting over elsewhere; None: not there."""
        node = self.images.layer_node(action.trajectory_id)
        mem_free = self._mem_free()
        if node is None or node not in mem_free:
            return None
        gi = _best_group(self.groups[node], units, elastic)
        if gi < 0:
            return None
        evict: tuple[str, ...] = ()
        short_mb = need - mem_free[node]
        if short_mb > 0:
            ev = self._evictions()
            victims = ev.victims(node, short_mb)
            if victims is None:
                return None
            ev.take(victims)
            evict = victims
        self._take(action, node, need, evicted=bool(evict))
        return node, gi, evict

    def _take(self, action: QueuedAction, node: str, need: int, evicted: bool) -> None:
        """A new trajectory's sandbox goes to `node`: pinned there this pass, its memory taken
        (all of the node's when it evicted: the surplus is free from the next round on), its
        image on its way there."""
        if not action.cost.sandbox:
            return
        tid = action.trajectory_id
        self.pins[tid] = node
        self.held_now[tid] = need
        mem_free = self._mem_free()
        mem_free[node] = 0 if evicted else mem_free[node] - need
        if action.image:
            self.images.placed(action, node)


class _Walk:
    """`fast_candidates`' pass over the queue, FCFS. Once no new trajectory fits in memory
    (`memory_full`), only actions of pinned trajectories and actions without a sandbox can
    start: over a `WaitingQueue` the pass then goes on over those alone
    (`WaitingQueue.behind_full_memory`), not over every new trajectory of a burst, which made
    each round O(queue) while a burst waited for memory (1312 new trajectories on one node:
    600 actions looked at per round, in 99% of the rounds). Not when a trajectory pinned in
    this pass has more actions queued: those are not indexed as pinned yet."""

    def __init__(self, queue: Sequence[QueuedAction], state: ClusterState) -> None:
        self._queue, self._state = queue, state
        self._it: Iterator[QueuedAction] = iter(queue)
        self._sparse = False

    def __iter__(self) -> _Walk:
        return self

    def __next__(self) -> QueuedAction:
        return next(self._it)

    def memory_full(self, at: QueuedAction, pinned_now: dict[str, str]) -> None:
        """No new trajectory fits from `at` on (`at` included): skip them."""
        q = self._queue
        if self._sparse or not isinstance(q, WaitingQueue):
            return
        if all(q.queued_of(t) <= 1 for t in pinned_now):
            self._it, self._sparse = q.behind_full_memory(self._state, at.action_id), True


class _LazyGroups(dict[str, list[list[int]]]):
    """node -> free core ids per NUMA group (ascending), computed on first access."""

    def __init__(self, state: ClusterState) -> None:
        super().__init__()
        self._state = state

    def __missing__(self, node: str) -> list[list[int]]:
        out = self._state.cpu[node].free_in_groups()
        self[node] = out
        return out


def _best_group(groups: list[list[int]], units: int, elastic: bool) -> int:
    """The NUMA group for an action needing `units` cores; -1 if none holds them.

    Rigid actions: best fit (fewest free cores), to keep large blocks whole. Elastic actions:
    the group with the most free cores, where they can grow.
    """
    best, best_len = -1, -1 if elastic else 1 << 30
    for i, g in enumerate(groups):
        n = len(g)
        if n >= units and ((n > best_len) if elastic else (n < best_len)):
            best, best_len = i, n
    return best
