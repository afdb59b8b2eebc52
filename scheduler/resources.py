"""Resource state of every pool: which units are free, who holds what.

This is plain in-memory state with `place` / `apply` / `share` / `release`; the live service
and the simulator both own one `ClusterState` and mutate it only through its methods, which
also cover pools going offline and back (`set_offline`), the GPU services resident on each
node (`attach_gpu_caches`, `load_gpu`, `learn_residency`) and rebuilding the state after a
restart (`restore`). Policies read it (or a `copy()`), never mutate the caller's instance.
"""

from __future__ import annotations

import copy as _copy
import math
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from scheduler.cluster_books import ClusterBooks
from scheduler.gpu_cache import Chunk, FootprintFn, GpuCache, GpuLoad
from scheduler.images import image_wait_s
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.pools import (
    GPU_CHUNK_SIZES,
    ApiPool,
    CpuNode,
    GpuNode,
    NumaShape,
    copy_cpu,
    copy_gpu,
    numa_shape,
)
from scheduler.snapshot import restore as restore_books
from scheduler.snapshot import snapshot

__all__ = ["GPU_CHUNK_SIZES", "ApiPool", "ClusterState", "CpuNode", "GpuNode", "NumaShape", "numa_shape"]


@dataclass
class ClusterState(ClusterBooks):
    """All pools plus the bookkeeping that ties allocations to them (`ClusterBooks`), and the
    one way to change them: `place` / `apply` / `share` / `release`, pools going offline, GPU
    residency, saving and restoring."""

    def copy(self) -> ClusterState:
        """An independent copy, much cheaper than deepcopy (allocations are immutable)."""
        return ClusterState(
            cpu={k: copy_cpu(n) for k, n in self.cpu.items()},
            gpu={k: copy_gpu(g) for k, g in self.gpu.items()},
            api={k: _copy.copy(a) for k, a in self.api.items()},
            trajectory_node=dict(self.trajectory_node),
            running=dict(self.running),
            expected_end_s=dict(self.expected_end_s),
            shared=set(self.shared),
            running_trajectory=dict(self.running_trajectory),
            trajectory_running=dict(self.trajectory_running),
            trajectory_used_s=dict(self.trajectory_used_s),
        )

    # ---- fit -------------------------------------------------------------------------------
    def cpu_candidates(self, action: QueuedAction, units: int) -> list[CpuNode]:
        """CPU nodes that can take `action` at `units` cores now (stickiness, memory included).

        A pinned trajectory's action that asks for more memory than its trajectory has
        reserved needs the difference free on its node.
        """
        pinned = self.trajectory_node.get(action.trajectory_id) if action.cost.sandbox else None
        if pinned is not None:
            node = self.cpu.get(pinned)
            if node is None or node.max_block() < units:
                return []
            extra = action.cost.memory_mb - node.trajectory_memory_mb.get(action.trajectory_id, 0)
            return [node] if extra <= 0 or node.memory_free_mb >= extra else []
        need = action.cost.memory_mb if action.cost.sandbox else 0
        nodes = [
            n for n in self.cpu.values() if n.online and n.max_block() >= units and n.memory_free_mb >= need
        ]
        # Balance memory: the node with the most free memory first (in an image: the node
        # where its image is soonest, `scheduler.images`; nowhere it cannot come).
        if action.image and action.cost.sandbox:
            waits = {
                n.name: image_wait_s(n.store, action.trajectory_id, action.image, action.image_mb, 0.0)
                for n in nodes
            }
            nodes = [n for n in nodes if waits[n.name] is not None]
            return sorted(nodes, key=lambda n: (waits[n.name] or 0.0, -n.memory_free_mb, n.name))
        return sorted(nodes, key=lambda n: (-n.memory_free_mb, n.name))

    def memory_extra_mb(self, action: QueuedAction) -> int:
        """MiB `action` needs reserved beyond what its trajectory holds: all of its memory for a
        new trajectory, the increase for a pinned one (0 when it asks for no more, and for
        actions without a sandbox)."""
        if action.cost.key is not ResourceKind.CPU or not action.cost.sandbox:
            return 0
        pinned = self.trajectory_node.get(action.trajectory_id)
        if pinned is None:
            return action.cost.memory_mb
        node = self.cpu.get(pinned)
        held = node.trajectory_memory_mb.get(action.trajectory_id, 0) if node is not None else 0
        return max(0, action.cost.memory_mb - held)

    def lacks_memory(self, action: QueuedAction) -> bool:
        """True for a CPU action of a new trajectory that no node has the memory for, or of a
        pinned one whose node lacks the increase it asks for.

        Such an action waits for memory, which only the actions of other pinned trajectories
        (they need no new memory) can bring about, by ending their trajectories or becoming
        idle (evictable): FCFS must let those pass.
        """
        if action.cost.key is not ResourceKind.CPU or not action.cost.sandbox:
            return False
        pinned = self.trajectory_node.get(action.trajectory_id)
        if pinned is not None:
            node = self.cpu.get(pinned)
            return node is not None and node.memory_free_mb < self.memory_extra_mb(action)
        need = action.cost.memory_mb
        return all(n.memory_free_mb < need for n in self.cpu.values() if n.online)

    def idle_trajectories(self, node: str, busy: Container[str]) -> list[str]:
        """Trajectories pinned to CPU node `node` with no action running and none in `busy`
        (those with queued actions), least recently used first: what eviction may take."""
        held = self.cpu[node].trajectory_memory_mb
        running = self.trajectory_running
        used = self.trajectory_used_s
        idle = [t for t in held if t not in running and t not in busy and t in self.trajectory_node]
        idle.sort(key=lambda t: used.get(t, -math.inf))  # never used here (restored): oldest
        return idle

    def place(self, action: QueuedAction, units: int, now_s: float = 0.0) -> Allocation | None:
        """A concrete allocation of `units` for `action`, or None when it does not fit now."""
        key = action.cost.key
        if key is ResourceKind.CPU:
            for node in self.cpu_candidates(action, units):
                ids = node.pick(units)
                if ids is not None:
                    return Allocation(action.action_id, key, node.name, units, ids)
            return None
        if key is ResourceKind.GPU:
            best: Allocation | None = None
            for gnode in self.gpu.values():
                chunk = gnode.pick(units, action.target)
                if chunk is None:
                    continue
                alloc = Allocation(action.action_id, key, gnode.name, units, chunk)
                if action.target in gnode.resident.get(chunk, ()):
                    return alloc
                best = best or alloc
            return best
        pool = self.api.get(action.target)
        if pool is None or not pool.fits(action.cost.api_quota, now_s):
            return None
        return Allocation(action.action_id, key, pool.name, 1)

    # ---- mutate ----------------------------------------------------------------------------
    def apply(self, alloc: Allocation, action: QueuedAction, now_s: float = 0.0) -> None:
        """Take the units of `alloc` for `action`. Raises ValueError if they are not free."""
        if alloc.action_id in self.running:
            raise ValueError(f"action {alloc.action_id} is already running")
        tid = action.trajectory_id
        if alloc.kind is ResourceKind.CPU:
            node = self.cpu[alloc.pool]
            if not node.free.issuperset(alloc.unit_ids):
                raise ValueError(f"cores {alloc.unit_ids} not free on {node.name}")
            if alloc.evict:
                self._evict(alloc)
            node.free.difference_update(alloc.unit_ids)
            if action.cost.sandbox:
                self._reserve(node, action, now_s)
        elif alloc.kind is ResourceKind.GPU:
            gnode = self.gpu[alloc.pool]
            if not gnode.free.issuperset(alloc.unit_ids):
                raise ValueError(f"gpus {alloc.unit_ids} not free on {gnode.name}")
            gnode.free.difference_update(alloc.unit_ids)
        else:
            pool = self.api[alloc.pool]
            pool.refill(now_s)
            pool.in_flight += 1
            if pool.quota_per_window is not None:
                pool.tokens -= action.cost.api_quota
        self.running[alloc.action_id] = alloc
        self._track(alloc)
        self._busy(alloc.action_id, tid)
        self.expected_end_s[alloc.action_id] = now_s + action.duration_s(alloc.units)

    def _reserve(self, node: CpuNode, action: QueuedAction, now_s: float) -> None:
        """Pin `action`'s trajectory to `node` (first action) and reserve its memory there (or
        the increase a later action asks for); a use of the trajectory (eviction order)."""
        tid = action.trajectory_id
        held = node.trajectory_memory_mb
        if tid not in self.trajectory_node:
            self.pin(tid, node.name)
            held[tid] = action.cost.memory_mb
            if action.image:
                self._pin_image(node, tid, action.image)
        elif held.get(tid, 0) < action.cost.memory_mb and self.trajectory_node[tid] == node.name:
            held[tid] = action.cost.memory_mb  # a later action asked for more: reserve it
        used = self.trajectory_used_s
        used.pop(tid, None)
        used[tid] = now_s

    def _evict(self, alloc: Allocation) -> None:
        """Release the idle trajectories `alloc` evicts (checked first: nothing changes on error)."""
        for tid in alloc.evict:
            if self.trajectory_node.get(tid) != alloc.pool or tid in self.trajectory_running:
                raise ValueError(f"cannot evict {tid!r} from {alloc.pool}: not an idle trajectory there")
        for tid in alloc.evict:
            self.close_trajectory(tid, keep_layer=True)

    def _pin_image(self, node: CpuNode, tid: str, image: str) -> None:
        """A new sandbox of `tid` runs in `image` on `node`: the image is in use there, and a
        layer the trajectory kept on another node is gone (it starts over here)."""
        for other in self.cpu.values():
            if other.store is not None and other is not node:
                other.store.layers.pop(tid, None)
        if node.store is not None:
            node.store.layers.pop(tid, None)
            node.store.users[tid] = image
            node.store.touch(image)

    def share(self, alloc: Allocation, action: QueuedAction, now_s: float = 0.0) -> None:
        """Let `action` ride on units already allocated to another action.

        GPU: it joins a chunk held by another action of the same model, and the worker scores
        them as one batch. CPU: it runs on the cores of another short action after it (and
        after the riders before it), from the same message (`scheduler.policies.cpu_batch`);
        its trajectory is pinned and its memory reserved (evicting `alloc.evict` first) as by
        `apply`, and its expected end follows theirs. Either way the units are freed when the
        last of them is released. Raises ValueError if the units are not held."""
        if alloc.action_id in self.running or alloc.kind is ResourceKind.API:
            raise ValueError(f"cannot share {alloc}")
        ids = alloc.unit_ids
        start_s = now_s
        if alloc.kind is ResourceKind.GPU:
            gnode = self.gpu[alloc.pool]
            if gnode.free.intersection(ids) or not any(
                a.kind is ResourceKind.GPU and a.pool == alloc.pool and a.unit_ids == ids
                for a in self.running.values()
            ):
                raise ValueError(f"gpus {ids} on {alloc.pool} are not held by a batch to join")
            gnode.riders[ids] = gnode.riders.get(ids, 0) + 1
        else:
            node = self.cpu[alloc.pool]
            ahead = [
                aid
                for aid, a in self.running_in(ResourceKind.CPU, alloc.pool, self.pool_key(alloc)[2]).items()
                if a.unit_ids == ids
            ]
            if not ids or node.free.intersection(ids) or not ahead:
                raise ValueError(f"cores {ids} on {alloc.pool} are not held by an action to follow")
            if alloc.evict:
                self._evict(alloc)
            if action.cost.sandbox:
                self._reserve(node, action, now_s)
            node.riders[ids] = node.riders.get(ids, 0) + 1
            start_s = max(now_s, *(self.expected_end_s.get(aid, now_s) for aid in ahead))
        self.shared.add(alloc.action_id)
        self.running[alloc.action_id] = alloc
        self._track(alloc)
        self._busy(alloc.action_id, action.trajectory_id)
        self.expected_end_s[alloc.action_id] = start_s + action.duration_s(alloc.units)

    def share_cores(self, alloc: Allocation, action: QueuedAction, now_s: float = 0.0) -> None:
        """Start `action` on CPU cores held by a running action, time-sharing them beside it
        (`alloc.shares`, `scheduler.policies.time_share`): its trajectory is pinned and its
        memory reserved (evicting `alloc.evict` first) as by `apply`. A core stays held until
        its holder and every sharer on it ended. The sharer's expected end is its duration
        from now, as if alone (no decision reads it: estimates leave sharers out, as riders).
        Raises ValueError if a core is free or its holder is gone."""
        node = self.cpu[alloc.pool] if alloc.kind is ResourceKind.CPU else None
        if node is None or not alloc.shares or alloc.action_id in self.running:
            raise ValueError(f"cannot time-share {alloc}")
        ids = alloc.unit_ids
        if not ids or node.free.intersection(ids) or node.vacated.intersection(ids):
            raise ValueError(f"cores {ids} on {alloc.pool} are not held by a running action")
        if alloc.evict:
            self._evict(alloc)
        if action.cost.sandbox:
            self._reserve(node, action, now_s)
        for c in ids:
            node.sharers[c] = node.sharers.get(c, 0) + 1
        self.shared.add(alloc.action_id)
        self.running[alloc.action_id] = alloc
        self._track(alloc)
        self._busy(alloc.action_id, action.trajectory_id)
        self.expected_end_s[alloc.action_id] = now_s + action.duration_s(alloc.units)

    def hold(self, alloc: Allocation, action: QueuedAction, now_s: float = 0.0) -> None:
        """`apply`, or `share` when its GPU chunk or CPU cores are already held (rebuilding
        state after a restart); `share_cores` for a sharer."""
        if alloc.shares:
            self.share_cores(alloc, action, now_s)
            return
        pools: dict[str, CpuNode] | dict[str, GpuNode] = (
            self.gpu if alloc.kind is ResourceKind.GPU else self.cpu
        )
        node = pools.get(alloc.pool) if alloc.kind is not ResourceKind.API else None
        if node is not None and alloc.unit_ids and not node.free.issuperset(alloc.unit_ids):
            self.share(alloc, action, now_s)
        else:
            self.apply(alloc, action, now_s)

    def release(self, action_id: str, now_s: float | None = None) -> Allocation | None:
        """Give back the units held by `action_id`; unknown ids are ignored (idempotent).

        `now_s`, when given, counts as a use of the action's trajectory (for eviction order).
        """
        alloc = self.running.pop(action_id, None)
        self.expected_end_s.pop(action_id, None)
        self.shared.discard(action_id)
        tid = self.running_trajectory.pop(action_id, None)
        if tid is not None:
            left = self.trajectory_running[tid] - 1
            if left:
                self.trajectory_running[tid] = left
            else:
                del self.trajectory_running[tid]
            if now_s is not None and tid in self.trajectory_used_s:
                del self.trajectory_used_s[tid]
                self.trajectory_used_s[tid] = now_s
        if alloc is None:
            return None
        self.by_pool[self.pool_key(alloc)].pop(action_id, None)
        if alloc.kind is ResourceKind.CPU and alloc.pool in self.cpu:
            self.cpu[alloc.pool].version += 1
        gone = bool(self.offline) and f"{alloc.kind}:{alloc.pool}" in self.offline
        if alloc.kind is ResourceKind.API:
            self.api[alloc.pool].in_flight -= 1
        elif alloc.shares:
            _release_sharer(self.cpu[alloc.pool], alloc, gone)
        else:
            node: CpuNode | GpuNode = (self.cpu if alloc.kind is ResourceKind.CPU else self.gpu)[alloc.pool]
            riders = node.riders.get(alloc.unit_ids, 0)
            if riders > 1:
                node.riders[alloc.unit_ids] = riders - 1
            elif riders == 1:  # a batch's riders take its cores over (none shares them: `time_share`)
                del node.riders[alloc.unit_ids]
            elif isinstance(node, CpuNode) and node.sharers:
                _vacate(node, alloc.unit_ids, gone)
            elif not gone:
                node.free.update(alloc.unit_ids)
        return alloc

    # ---- pools going away and coming back ----------------------------------------------------
    def set_offline(self, pools: set[str]) -> tuple[set[str], set[str], list[str]]:
        """Make exactly `pools` ("cpu:<node>", "gpu:<node>") offline: nothing is placed there,
        and their free units stay out of placement until they are back.

        Returns (pools gone offline, pools back, trajectories pinned to a CPU node gone offline).
        Those trajectories are not unpinned here: their owner releases them (their sandboxes are
        gone with the node, and the owner keeps the books of sandboxes)."""
        went = pools - self.offline
        back = self.offline - pools
        lost = [t for t, n in self.trajectory_node.items() if f"cpu:{n}" in went]
        self.offline = set(pools)
        if not went and not back:
            return went, back, lost
        held: dict[tuple[ResourceKind, str], set[int]] = {}
        for a in self.running.values():
            held.setdefault((a.kind, a.pool), set()).update(a.unit_ids)
        for name, node in self.cpu.items():
            online = f"cpu:{name}" not in self.offline
            node.version += node.online != online  # what policies keep per node is stale
            node.online = online
            all_cores = {c for g in node.numa for c in g}
            node.free = all_cores - held.get((ResourceKind.CPU, name), set()) if node.online else set()
        for name, gnode in self.gpu.items():
            if f"gpu:{name}" in self.offline:
                gnode.free = set()
            else:
                gnode.free = set(range(gnode.num_gpus)) - held.get((ResourceKind.GPU, name), set())
        return went, back, lost

    # ---- GPU residency ---------------------------------------------------------------------------
    def attach_gpu_caches(self, footprint_mb: FootprintFn) -> None:
        """Track the services resident on every GPU node, each instance taking
        `footprint_mb(service, units)` MiB per GPU (evict on execution, `scheduler.gpu_cache`)."""
        for name, node in self.gpu.items():
            cache = GpuCache(node.gpu_memory_mb, footprint_mb)
            node.resident = cache.resident  # policies see residency through the node
            self.gpu_cache[name] = cache

    def load_gpu(self, load: GpuLoad, now_s: float) -> None:
        """Carry out a planned GPU load (`scheduler.round`): its victims are gone, its service
        resident on its chunk."""
        cache = self.gpu_cache.get(load.pool)
        if cache is not None:
            cache.apply(load, now_s)

    def learn_residency(
        self,
        node: str,
        resident: dict[Chunk, list[str]],
        now_s: float,
        host_resident: dict[Chunk, list[str]] | None = None,
    ) -> None:
        """What GPU `node` reports it holds (chunk -> services, most recently used last)
        replaces what the state predicted; so does what it keeps in host memory only
        (`host_resident`, issue 38; None: the node reports no host tier, nothing changes)."""
        gnode = self.gpu.get(node)
        if gnode is None:
            return
        cache = self.gpu_cache.get(node)
        if cache is None:
            gnode.resident = {c: list(v) for c, v in resident.items() if v}
        else:
            cache.learn(resident, now_s, host_resident)
        if host_resident is not None:
            gnode.host_tier = True
            on_device = gnode.resident
            host = {c: [s for s in v if s not in on_device.get(c, ())] for c, v in host_resident.items()}
            gnode.host_resident.clear()  # in place: it may be the cache's own map
            gnode.host_resident.update({c: v for c, v in host.items() if v})

    # ---- persistence (scheduler.snapshot) ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The bookkeeping to rebuild this state on a fresh cluster of the same shape."""
        return snapshot(self)

    def restore(self, d: dict[str, Any]) -> None:
        """Re-apply saved bookkeeping (`to_dict`, or one rebuilt from dispatch records after a
        restart) onto a freshly built (all-free) cluster of the same shape."""
        restore_books(self, d)


def _release_sharer(node: CpuNode, alloc: Allocation, gone: bool) -> None:
    """A time sharer ended (`ClusterState.share_cores`): a core whose holder ended before it
    is free once its last sharer ends."""
    sharers = node.sharers
    for c in alloc.unit_ids:
        left = sharers[c] - 1
        if left:
            sharers[c] = left
            continue
        del sharers[c]
        if c in node.vacated:  # its holder ended before it
            node.vacated.discard(c)
            if not gone:
                node.free.add(c)


def _vacate(node: CpuNode, cores: tuple[int, ...], gone: bool) -> None:
    """A holder ended on a node where cores are time-shared: its cores with sharers stay held
    (vacated) until the last of them ends, the others are free."""
    for c in cores:
        if c in node.sharers:
            node.vacated.add(c)
        elif not gone:
            node.free.add(c)
