"""The simulator's CPU execution: sandboxes and pods starting, batch riders queued on a
leader's cores, core loans and time sharers changing a running action's speed.

A base class of `scheduler.sim.engine.Simulator` (see its module doc for the model).
"""

from __future__ import annotations

from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.sim.running import FETCHED, FINISH, JOIN, Running, SimBase
from scheduler.sim.workload import SimAction


class CpuExecution(SimBase):
    """Carrying CPU allocations, riders and sharers out on the simulated nodes."""

    def _evicted(self, alloc: Allocation) -> None:
        """Memory is a cache: the sandboxes of the trajectories `alloc` evicted are gone (an
        image trajectory's copy-on-write layer stays on the node, `scheduler.images`)."""
        for victim in alloc.evict:
            self.sandboxes.discard(victim)
            self.evicted.add(victim)
            self.result.evictions += 1
            self.layer_node[victim] = alloc.pool

    def _fetch(
        self, now: float, node: str, image: str, size_mb: int, evict: tuple[str, ...] | None = None
    ) -> float:
        """Bring `image` onto `node` (a fetch order, or a new sandbox's need): seconds until it
        is there (0: held)."""
        store = self.state.cpu[node].store
        if store is None:
            return 0.0
        if store.has(image):
            return max(0.0, store.fetch(image, size_mb, now) - now)
        ready = store.fetch(image, size_mb, now, evict)
        self.result.image_fetches += 1
        self.result.image_fetch_mb += size_mb
        self._push(ready, FETCHED, (node, image))
        return ready - now

    def _fetched(self, node: str, image: str) -> bool:
        """A fetch ended: the image is held (a round may now place by it)."""
        store = self.state.cpu[node].store
        if store is not None:
            store.arrived(image)
        return True

    def _sandbox_image_s(self, now: float, qa: QueuedAction, node: str) -> float:
        """A new sandbox of an image trajectory: seconds it waits for its image (none where its
        kept layer is: it resumes losslessly)."""
        tid = qa.trajectory_id
        if self.layer_node.pop(tid, None) == node and tid in self.evicted:
            self.evicted.discard(tid)
            self.result.layer_resumes += 1
        wait = self._fetch(now, node, qa.image, qa.image_mb)
        self.result.image_wait_s += wait
        return wait

    def _begin_cpu(self, now: float, run: Running, sa: SimAction) -> None:
        """A CPU action starts on its cores now: its sandbox (or pod) first when its
        trajectory has none, then its work."""
        qa, alloc = run.qa, run.alloc
        pod_delay_s = 0.0
        if qa.cost.sandbox and qa.trajectory_id not in self.sandboxes:
            self.sandboxes.add(qa.trajectory_id)
            image_s = self._sandbox_image_s(now, qa, alloc.pool) if qa.image else 0.0
            if self.pods is not None:  # a pod is created and bound, then starts
                pod_delay_s = self.pods.ready_delay_s(now, qa.trajectory_id) + image_s
                run.setup_s += pod_delay_s
            else:  # a fresh one, after an eviction too
                run.setup_s += self.params.sandbox_start_s + image_s
            if qa.trajectory_id in self.evicted:
                self.evicted.discard(qa.trajectory_id)
                self.result.sandbox_resets += 1
        run.setup_s += self.params.exec_overhead_s
        if self.cpu_sharing:
            if pod_delay_s > 0:
                self._push(now + pod_delay_s, JOIN, qa.action_id)
            else:
                self._join_shared(now, qa.action_id)
            return
        run.end_s = now + run.setup_s + sa.true_duration_s(alloc.units)
        run.seg_s, run.units_now = now + run.setup_s, alloc.units
        self._push(run.end_s, FINISH, qa.action_id)

    def _cpu_chain_head(self, rider: Allocation) -> str:
        """The running action a rider of an earlier round's batch queues behind: the one on its
        cores (it holds the rest of the batch's chain, `_next_rider`)."""
        for aid, run in self.running.items():
            a = run.alloc
            if (
                a.kind is ResourceKind.CPU
                and a.pool == rider.pool
                and a.unit_ids == rider.unit_ids
                and not a.shares
            ):
                return aid
        raise AssertionError(f"rider {rider.action_id} joins no running batch on {rider.unit_ids}")

    def _next_rider(self, now: float, aid: str) -> None:
        """CPU action `aid` ended: the next rider queued behind it starts on its cores."""
        chain = self._next_cpu.pop(aid, None)
        if not chain:
            return
        (qa, alloc), rest = chain[0], chain[1:]
        run = Running(qa, alloc, now, 0.0)
        self.running[qa.action_id] = run
        self._begin_cpu(now, run, self._sim_action(qa.action_id))
        if rest:
            self._next_cpu[qa.action_id] = rest

    def _resize(self, now: float, aid: str, lent: int) -> None:
        """A running CPU action now has `lent` cores on loan besides its own: the work it has
        left runs from now at the new count (by its true duration curve)."""
        run = self.running.get(aid)
        if run is None or run.end_s is None:
            return
        run.lent = lent
        run.lent_max = max(run.lent_max, lent)
        self._rerate(now, aid)
        if self.time_shared is not None:  # its weight per core changed: so did its sharers' speed
            for other in self.time_shared.reweigh(aid, run.alloc.units + lent):
                self._rerate(now, other)

    def _rerate(self, now: float, aid: str) -> None:
        """The cores' worth running CPU action `aid` gets may have changed (a loan, a sharer
        came or went): the work it has left runs from now at the new worth."""
        run = self.running.get(aid)
        if run is None or run.end_s is None:
            return
        own = float(run.alloc.units + run.lent)
        units = self.time_shared.worth(aid, own) if self.time_shared is not None else own
        if units == run.units_now:
            return
        sa = self._sim_action(aid)
        if now > run.seg_s:  # still in its setup: no work done yet
            run.left = max(0.0, run.left - (now - run.seg_s) / sa.true_duration_s(run.units_now))
            run.seg_s = now
        run.units_now = units
        run.end_s = run.seg_s + run.left * sa.true_duration_s(units)
        self._push(run.end_s, FINISH, aid)

    def _start_sharer(self, now: float, qa: QueuedAction, alloc: Allocation) -> None:
        """A time sharer starts on cores held by a running action, beside it (see the module
        doc): its holder and the cores' other tenants slow down from now."""
        assert self.time_shared is not None
        holders = [
            a
            for aid, a in self.state.running_in(
                ResourceKind.CPU, alloc.pool, self.state.pool_key(alloc)[2]
            ).items()
            if not a.shares and aid not in self.state.shared and alloc.unit_ids[0] in a.unit_ids
        ]
        self.state.share_cores(alloc, qa, now)
        self._evicted(alloc)
        run = Running(qa, alloc, now, 0.0)
        self.running[qa.action_id] = run
        self._begin_cpu(now, run, self._sim_action(qa.action_id))
        holder = holders[0].action_id if holders else None
        held = self.running[holder].alloc.units + self.running[holder].lent if holder else 1
        touched = self.time_shared.join(qa.action_id, alloc.pool, alloc.unit_ids, holder, held)
        self.result.time_shared += 1
        for aid in (qa.action_id, *touched):
            self._rerate(now, aid)

    def _join_shared(self, now: float, aid: str) -> None:
        """A pod's action starts using its node's time-shared cores."""
        run = self.running[aid]
        sa = self._sim_action(aid)
        self.shared[run.alloc.pool].add(now, aid, sa, run.alloc.units, self.model.cap_cores)
        self._reschedule_shared(run.alloc.pool)
