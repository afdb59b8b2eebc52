"""The simulator's side of nodes joining and leaving (`scheduler.sim.node_events`).

A base class of `scheduler.sim.engine.Simulator`. What each change does, as the live service
does it (issue 39):
- *join*: a node that left is back (`ClusterState.set_offline`; a lost one comes back empty:
  no sandbox, no GPU instance); a new name is a new node of the event's shape (the cluster's
  by default), which the policies see from the next round, as they see any node.
- *drain*: nothing new is placed there (the pool goes offline); its running actions finish.
  Trajectories pinned there move: an idle one now, a running one when its action ends, each
  with a fresh sandbox on its next CPU action (a reset, counted in `sandbox_resets`).
- *lose*: the pool goes offline and everything on it is gone: its running actions (riders
  and time sharers included) are submitted again at once, under a new id (`<id>~<n>`) so
  that nothing of the lost run can end them, keeping their first submission (the ACT counts
  the lost time); `SimResult.node_retries` counts them. Its trajectories move as on a drain.
"""

from __future__ import annotations

from scheduler.gpu_cache import GpuCache
from scheduler.images import ImageStore
from scheduler.model import ResourceKind
from scheduler.pools import CpuNode, GpuNode
from scheduler.sim.cpu_share import SharedNode
from scheduler.sim.node_events import NodeChange, NodeEvent
from scheduler.sim.running import Running, SimBase


class NodeExecution(SimBase):
    """Applying node events to the simulated cluster."""

    _lost_nodes: set[str]  # pools ("cpu:<node>") lost and not back yet: they come back empty

    def _node_event(self, now: float, ev: NodeEvent) -> None:
        state = self.state
        pools = state.gpu if ev.kind is ResourceKind.GPU else state.cpu
        if ev.change is NodeChange.JOIN:
            if ev.node not in pools:
                self._new_node(ev)
            elif ev.pool in self._lost_nodes:
                self._lost_nodes.discard(ev.pool)
                if ev.kind is ResourceKind.GPU:
                    self._gpu_cache(ev.node)  # its instances went with it
            state.set_offline(state.offline - {ev.pool})
            self.result.node_joins += 1
            return
        if ev.node not in pools or ev.pool in state.offline:
            return  # not there: nothing leaves
        _, _, pinned = state.set_offline(state.offline | {ev.pool})
        if ev.change is NodeChange.LOSE:
            self._lose(now, ev)
            self._lost_nodes.add(ev.pool)
        self.result.node_leaves += 1
        for tid in pinned:
            if not state.trajectory_running.get(tid):
                self._move_trajectory(tid)

    def _left_node(self, tid: str) -> None:
        """An action of `tid` ended: if its trajectory is pinned to a node that left, it moves."""
        node = self.state.trajectory_node.get(tid)
        if (
            node is not None
            and f"cpu:{node}" in self.state.offline
            and not self.state.trajectory_running.get(tid)
        ):
            self._move_trajectory(tid)

    def _move_trajectory(self, tid: str) -> None:
        """Unpin `tid` from its node; its next CPU action starts a fresh sandbox elsewhere."""
        self.state.close_trajectory(tid)
        if tid in self.sandboxes:
            self.sandboxes.discard(tid)
            self.evicted.add(tid)

    def _lose(self, now: float, ev: NodeEvent) -> None:
        """Everything running on the lost node is submitted again (see the module doc)."""
        state = self.state
        lost = [aid for aid, a in state.running.items() if a.kind is ev.kind and a.pool == ev.node]
        for aid in lost:
            self._next_cpu.pop(aid, None)  # its riders are on the node too: in `lost`
            state.release(aid)
            run = self.running.pop(aid, None)
            if run is not None:
                self._drop_run(now, aid, run)
            self._retry_lost(now, aid)
        for key in [k for k in self._ready_at if k[0] == ev.node]:
            del self._ready_at[key]

    def _drop_run(self, now: float, aid: str, run: Running) -> None:
        if self.time_shared is not None and aid in self.time_shared.cores:
            self.time_shared.leave(aid)  # its other tenants are on the lost node too
        if run.alloc.kind is ResourceKind.CPU and self.cpu_sharing:
            self.shared[run.alloc.pool].remove(now, aid)
        group = self.groups.get((run.alloc.pool, run.alloc.unit_ids))
        if run.alloc.kind is ResourceKind.GPU and group is not None:
            group.remove(now, aid)

    def _retry_lost(self, now: float, aid: str) -> None:
        pend = self.pending.pop(aid)
        base, _, n = aid.partition("~")
        new = f"{base}~{int(n or 0) + 1}"
        self.pending[new] = pend
        self.result.node_retries += 1
        self._submit(now, pend.traj, pend.step, new)

    def _new_node(self, ev: NodeEvent) -> None:
        spec = self.scenario.cluster
        if ev.kind is ResourceKind.GPU:
            self.state.gpu[ev.node] = GpuNode(ev.node, ev.gpus or spec.gpus_per_node, spec.gpu_memory_mb)
            self._gpu_cache(ev.node)
            return
        cores = ev.cores or spec.cores_per_node
        node = CpuNode.uniform(
            ev.node, cores, ev.memory_mb or spec.memory_mb_per_node, ev.numa_groups or spec.numa_groups
        )
        if spec.image_mb_per_s > 0:
            node.store = ImageStore(spec.image_store_mb, spec.image_mb_per_s)
        self.state.cpu[ev.node] = node
        self.shared[ev.node] = SharedNode(float(cores))

    def _gpu_cache(self, name: str) -> None:
        """A fresh residency cache for GPU node `name` (nothing resident), as
        `ClusterState.attach_gpu_caches` and the host tier give every node at the start."""
        node = self.state.gpu[name]
        cache = GpuCache(node.gpu_memory_mb, self._footprint_mb)
        node.resident = cache.resident
        self.caches[name] = cache
        self._host_tier_of(name, cache)
