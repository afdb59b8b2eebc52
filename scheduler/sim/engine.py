"""The discrete-event simulator: drives a policy object exactly as the live service does.

Loop: events (submit, finish, wake) advance simulated time; after the events of one instant,
if anything changed and actions wait, one scheduling round runs (`scheduler.round.Round`, the
live loop's round: fair ordering, `policy.decide`, GPU and CPU batch riders, the eviction plan) on the
simulator's own `ClusterState`, and the plan is carried out in order. Policies see only
estimates (`DurationEstimator`, learned online from completions); the true durations come from
the workload. Execution follows the policy's declared `ExecutionModel` (`scheduler.execution`):
exclusive cores, time-shared pods, GPU residency, API control, and cores lent to running
malleable actions (`lend_cores`): a loan changes the action's speed from that instant, by the
same duration curve, applied to the work it has left. CPU riders (`cpu_batch`) are dispatched
with their leader (pinned, memory reserved) and start one after another on its cores, each
when the one before it ends. Time sharers (`time_share`) start at once on cores held by a
running action, which CFS splits by the sandboxes' weights (`scheduler.sim.shared_cores`):
each tenant's speed changes whenever a tenant of its cores comes or goes.

`check_invariants` (a debug mode, used by the tests) asserts after every round that work is
conserved (no core idles on a node while a malleable action running there could use it) and
that time sharing keeps its bounds (`scheduler.policies.time_share.oversubscribed`).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from scheduler.estimator import DurationEstimator
from scheduler.execution import GpuResidency, execution_of
from scheduler.gpu_cache import GpuLoad
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies.base import Policy
from scheduler.policies.cpu_batch import CpuBatchSpec
from scheduler.policies.dedicated_gpu import dedicated_groups
from scheduler.policies.malleable import idle_while_malleable
from scheduler.policies.time_share import oversubscribed
from scheduler.queue import WaitingQueue
from scheduler.resources import ApiPool
from scheduler.round import FairShareSpec, Round, RoundPlan
from scheduler.sim.cpu_exec import CpuExecution
from scheduler.sim.cpu_share import SharedNode
from scheduler.sim.gpu_exec import GpuExecution
from scheduler.sim.gpu_share import BatchedGroup
from scheduler.sim.node_events import NodeEvent
from scheduler.sim.node_exec import NodeExecution
from scheduler.sim.pods import PodStarts
from scheduler.sim.results import ActionRecord, SimResult
from scheduler.sim.running import FETCHED, FINISH, JOIN, NODE, SHARED, SUBMIT, Pending, Running
from scheduler.sim.scenarios import Scenario
from scheduler.sim.shared_cores import SharedCores


@dataclass
class Simulator(CpuExecution, GpuExecution, NodeExecution):
    """Run `scenario` under `policy`. `learn` feeds completions back into the estimator; `fair`
    orders the jobs' actions as the live service does (its default; None: FCFS as queued);
    `cpu_batch` lets short CPU actions ride in batches as the live service does (None: off)."""

    scenario: Scenario
    policy: Policy
    learn: bool = True
    estimator: DurationEstimator | None = None
    fair: FairShareSpec | None = field(default_factory=FairShareSpec)
    check_invariants: bool = False
    cpu_batch: CpuBatchSpec | None = None
    _events: list[tuple[float, int, int, object]] = field(default_factory=list)
    _seq: int = 0

    def __post_init__(self) -> None:
        sc = self.scenario
        self.params = sc.exec_params
        self.state = sc.cluster.build()
        self.estimator = self.estimator or DurationEstimator(priors=dict(sc.priors))
        self.provider = {
            n: ApiPool(p.name, p.max_concurrency, p.quota_per_window, p.window_s)
            for n, p in self.state.api.items()
        }
        # How the policy's decisions run (scheduler.execution): read once, typed.
        self.model = ex = execution_of(self.policy)
        self.cpu_sharing = ex.cpu_sharing
        self.residency = ex.gpu_residency
        self.gpu_sharing = ex.gpu_sharing
        self.pods = PodStarts(ex.pod_start) if ex.cpu_sharing and ex.pod_start is not None else None
        self.state.attach_gpu_caches(self._footprint_mb)  # the policy sees residency through the state
        self.caches = self.state.gpu_cache
        self._attach_host_tier()  # evict on execution's host tier (`ClusterSpec.host_memory_mb`)
        if self.residency is GpuResidency.DEDICATED:
            services = sorted(sc.model_mb)
            groups = (
                ex.preload(self.state, services)
                if ex.preload is not None
                else list(dedicated_groups(self.state, services, 4).items())
            )
            for svc, (node_name, chunk) in groups:
                self.caches[node_name].preload(chunk, svc)
        self.shared = {n: SharedNode(float(node.cores)) for n, node in self.state.cpu.items()}
        # GPU groups serving several calls at once (dedicated-gpu with max_concurrent > 1)
        self.groups: dict[tuple[str, tuple[int, ...]], BatchedGroup] = {}
        self.queue = WaitingQueue()
        self.pending: dict[str, Pending] = {}
        self.running: dict[str, Running] = {}
        self.sandboxes: set[str] = set()  # trajectories with a live sandbox
        self.evicted: set[str] = set()  # trajectories whose sandbox was evicted, not yet restarted
        self.layer_node: dict[str, str] = {}  # evicted trajectory -> its node (`scheduler.images`)
        self.result = SimResult(policy=self.policy.name, scenario=sc.name)
        batch = self.params.max_batch
        chunks = {s: (1, 2, 4, 8) for s in sc.model_mb}  # every scenario's calls take buddy chunks
        self.round = Round(
            self.policy,
            fair=self.fair,
            max_batch=(lambda _s: batch) if batch > 1 else None,
            gpu_services=chunks,
            cpu_batch=self.cpu_batch,
            observed=lambda qa, units: self.estimator.observed_s(qa.kind, units) if self.estimator else None,
        )
        self._riding: dict[str, list[Allocation]] = {}  # GPU allocation -> its riders this round
        # CPU action running -> the riders that run after it on its cores, in order
        self._next_cpu: dict[str, list[tuple[QueuedAction, Allocation]]] = {}
        self._last_round_s = -1e18
        self._wakes: set[float] = set()
        self._lending = ex.lend_cores and not ex.cpu_sharing
        self.time_shared = SharedCores(ex.time_share) if ex.time_share is not None else None
        self._ready_at: dict[tuple[str, tuple[int, ...], str], float] = {}  # warm restores' ends
        self._warming = ex.warm_gpu and self.residency is GpuResidency.CACHE and bool(self.state.gpu)
        self._lost_nodes = set()

    # ---- public ------------------------------------------------------------------------------
    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        for i, traj in enumerate(self.scenario.trajectories):
            if traj.steps:
                self._push(traj.start_s + traj.steps[0].think_s, SUBMIT, (i, 0, None))
        for ev in self.scenario.node_events:  # nodes joining and leaving (`node_exec`)
            self._push(ev.at_s, NODE, ev)
        if self._warming:
            self._wake(0.0)  # place the services before the first call comes
        dirty = False
        now = 0.0
        events, pop, handle = self._events, heapq.heappop, self._handle
        while events:
            now = events[0][0]
            while events and events[0][0] == now:
                _, kind, _, data = pop(events)
                dirty |= handle(now, kind, data)
            if dirty and (self.queue or self._lending or self._warming):
                dirty = self._maybe_round(now)
        # the last completion: the heap may still hold finish events that a loan or a sharer
        # superseded, which end no action
        self.result.makespan_s = max((r.ended_s for r in self.result.records), default=now)
        self.result.wall_s = time.perf_counter() - wall0
        self.result.unfinished = len(self.queue) + len(self.running)
        return self.result

    # ---- events ------------------------------------------------------------------------------
    def _handle(self, now: float, kind: int, data: object) -> bool:
        if kind == SUBMIT:
            assert isinstance(data, tuple)
            self._submit(now, *data)
            return True
        if kind == FINISH:
            assert isinstance(data, str)
            run = self.running.get(data)
            if run is None or (run.end_s is not None and now != run.end_s):
                return False  # superseded: a loan changed its speed
            self._finish(now, data)
            return True
        if kind == SHARED:
            assert isinstance(data, tuple)
            key, version = data
            sn = self.shared[key] if isinstance(key, str) else self.groups[key]
            if sn.version != version:
                return False
            for aid in sn.pop_done(now):
                run = self.running[aid]
                # a pod's start-up came before its work; the exec overhead (or setup) is after
                tail = (
                    self.params.exec_overhead_s
                    if run.alloc.kind is ResourceKind.CPU and self.pods
                    else run.setup_s
                )
                self._push(now + tail, FINISH, aid)
            self._reschedule_shared(key)
            return False
        if kind == JOIN:
            assert isinstance(data, str)
            if data in self.running:  # (not if its node was lost meanwhile)
                self._join_shared(now, data)
            return False
        if kind == NODE:
            assert isinstance(data, NodeEvent)
            self._node_event(now, data)
            return True
        if kind == FETCHED:
            assert isinstance(data, tuple)
            return self._fetched(*data)
        self._wakes.discard(now)
        return True

    def _submit(self, now: float, traj_i: int, step_i: int, retry_of: str | None) -> None:
        traj = self.scenario.trajectories[traj_i]
        sa = traj.steps[step_i].action
        aid = retry_of or f"{traj.trajectory_id}/{step_i}"
        qa = QueuedAction(aid, traj.trajectory_id, sa.cost(), now, kind=sa.kind, target=sa.target)
        if sa.image:
            qa.image, qa.image_mb = sa.image, sa.image_mb
        assert self.estimator is not None
        self.estimator.annotate(qa)
        self.queue.append(qa)
        if retry_of is None:
            self.pending[aid] = Pending(traj_i, step_i, now)

    def _maybe_round(self, now: float) -> bool:
        gap = self.params.round_gap_s
        if now < self._last_round_s + gap:
            self._wake(self._last_round_s + gap)
            return True
        self._last_round_s = now
        for node, chunk, service in self.round.retire(self.state, now):
            self.caches[node].unload(chunk, service)
            self.result.warm_unloads += 1
        if not self.queue:  # nothing to place: lend the cores that came back, warm GPUs
            idle = self.round.idle(self.queue, self.state, now)
            for aid, (_, ids) in idle.lends.items():
                self._resize(now, aid, len(ids))
            for load in idle.warm:
                self._warm(now, load)
            self._check(now)
            return False
        if self.residency is GpuResidency.KEEPALIVE:
            for cache in self.caches.values():  # what the policy sees must be what is loaded
                self.result.unloads += cache.expire(now - self.model.keep_alive_s)
        plan = self.round.plan(self.queue, self.state, now)
        self.result.decision_s.append(plan.decision_s)
        self.result.queue_len.append(len(self.queue))
        self._carry_out(now, plan)
        self._check(now)
        self._wake_for_quota(now)
        return False

    def _carry_out(self, now: float, plan: RoundPlan) -> None:
        """Carry a round's plan out in its order (`RoundPlan`): allocations (a GPU one with its
        riders), CPU riders queued behind their leaders, loans, sharers, warm restores."""
        lead = {(a.kind, a.pool, a.unit_ids): a.action_id for a in plan.allocs}
        behind: list[Allocation] = []
        for r in plan.riders:
            if r.kind is ResourceKind.GPU:
                self._riding.setdefault(lead[(r.kind, r.pool, r.unit_ids)], []).append(r)
            else:
                behind.append(r)
        for f in plan.fetches:
            self._fetch(now, f.node, f.image, f.size_mb, f.evict)
        for alloc in plan.allocs:
            self._start(now, self.queue.pop(alloc.action_id), alloc, plan.gpu_loads.get(alloc.action_id))
        for r in behind:  # after every allocation, as the live dispatch applies them
            qa = self.queue.pop(r.action_id)
            self.state.share(r, qa, now)
            self._evicted(r)
            head = lead.get((r.kind, r.pool, r.unit_ids)) or self._cpu_chain_head(r)
            self._next_cpu.setdefault(head, []).append((qa, r))
        for aid, (_, ids) in plan.lends.items():
            self._resize(now, aid, len(ids))
        for r in plan.sharers:
            self._start_sharer(now, self.queue.pop(r.action_id), r)
        for load in plan.warm:
            self._warm(now, load)

    def _wake_for_quota(self, now: float) -> None:
        """Quota refills are not events: wake up when the head of each API pool's line fits."""
        seen: set[str] = set()
        for qa in self.queue.values() if self.state.api else ():
            if qa.cost.key is ResourceKind.API and qa.target in self.state.api:
                if qa.target in seen:
                    continue
                seen.add(qa.target)
                nxt = self.state.api[qa.target].next_fit_s(qa.cost.api_quota, now)
                if nxt is not None and nxt > now:
                    self._wake(nxt)
                if len(seen) == len(self.state.api):
                    break

    def _check(self, now: float) -> None:
        """Debug mode: assert work conservation after a round (see the module doc)."""
        if self.check_invariants and self._lending:
            bad = idle_while_malleable(self.round.borrowers(), self.round.lent, self.state)
            assert not bad, f"work conservation at t={now:.3f}: {bad}"
        if self.check_invariants and self.model.time_share is not None:
            bad = oversubscribed(self.state, self.model.time_share)
            assert not bad, f"time sharing at t={now:.3f}: {bad}"

    # ---- execution ---------------------------------------------------------------------------
    def _start(self, now: float, qa: QueuedAction, alloc: Allocation, load: GpuLoad | None = None) -> None:
        sa = self._sim_action(qa.action_id)
        if self.gpu_sharing and alloc.kind is ResourceKind.GPU:
            self.state.hold(alloc, qa, now)  # the group may already be serving calls
        else:
            self.state.apply(alloc, qa, now)
        run = Running(qa, alloc, now, 0.0)
        self.running[qa.action_id] = run
        if alloc.kind is ResourceKind.CPU:
            self._evicted(alloc)
            self._begin_cpu(now, run, sa)
            return
        if alloc.kind is ResourceKind.GPU:
            run.setup_s = self._gpu_setup_s(now, alloc, qa.target, load)
            batch = self._riding.pop(qa.action_id, None)
            if batch:
                self._start_batch(now, run, batch)
                return
            if self.gpu_sharing:
                key = (alloc.pool, alloc.unit_ids)
                group = self.groups.get(key)
                if group is None:
                    group = self.groups[key] = BatchedGroup(self.params.batch_amortised_share)
                group.add(now, qa.action_id, sa.true_duration_s(alloc.units))  # preloaded: no setup
                self._reschedule_shared(key)
                return
            self._push(now + run.setup_s + sa.true_duration_s(alloc.units), FINISH, qa.action_id)
            return
        provider = self.provider[alloc.pool]
        if provider.fits(qa.cost.api_quota, now):
            provider.refill(now)
            provider.in_flight += 1
            if provider.quota_per_window is not None:
                provider.tokens -= qa.cost.api_quota
            self._push(now + sa.true_duration_s(1), FINISH, qa.action_id)
            return
        run.rejected = True
        self.result.rejected_calls += 1
        if self.model.api_control:
            self.result.limit_violations += 1
        self._push(now + self.params.api_reject_s, FINISH, qa.action_id)

    def _finish(self, now: float, aid: str) -> None:
        run = self.running.pop(aid)
        self.state.release(aid, now)
        if self.time_shared is not None and aid in self.time_shared.cores:
            for other in self.time_shared.leave(aid):  # the other tenants of its cores speed up
                self._rerate(now, other)
        if self._next_cpu:
            self._next_rider(now, aid)
        if self.residency is GpuResidency.KEEPALIVE and run.alloc.kind is ResourceKind.GPU:
            self.caches[run.alloc.pool].touch(run.alloc.unit_ids, run.qa.target, now)  # idle from now
        pend = self.pending[aid]
        sa = self._sim_action(aid)
        if run.alloc.kind is ResourceKind.API and not run.rejected:
            self.provider[run.alloc.pool].in_flight -= 1
        if run.rejected:
            pend.retries += 1
            elapsed = now - pend.first_submit_s
            retries = self.model.retries
            if pend.retries <= retries.max_retries and elapsed < retries.timeout_s:
                backoff = retries.backoff_s * 2 ** (pend.retries - 1)
                self._push(now + backoff, SUBMIT, (pend.traj, pend.step, aid))
                return
        exec_s = now - run.started_s - run.setup_s
        slowed_s = 0.0
        if run.alloc.kind is ResourceKind.CPU:  # by time sharing (pods: by contention)
            own = min(run.alloc.units, self.model.cap_cores) if self.cpu_sharing else run.alloc.units
            slowed_s = max(0.0, exec_s - sa.true_duration_s(own))
        if run.lent_max or run.alloc.shares:
            # learn what it takes on its own cores, as for any other run: a sharer's work is
            # the CPU time it used (what the live worker measures), and leaving sharers out
            # would leave only the exclusive runs, which under sharing are the long survivors
            exec_s = sa.true_duration_s(run.alloc.units)
        if self.learn and not run.rejected and not self.cpu_sharing and not self.gpu_sharing:
            assert self.estimator is not None
            self.estimator.observe(sa.kind, run.alloc.units, exec_s)
        self.result.records.append(
            ActionRecord(
                action_id=aid,
                trajectory_id=run.qa.trajectory_id,
                kind=sa.kind,
                key=str(sa.key),
                submitted_s=pend.first_submit_s,
                started_s=run.started_s,
                ended_s=now,
                units=run.alloc.units,
                setup_s=run.setup_s,
                retries=pend.retries,
                failed=run.rejected,
                slowed_s=slowed_s,
            )
        )
        del self.pending[aid]
        traj = self.scenario.trajectories[pend.traj]
        if pend.step + 1 < len(traj.steps):
            if self.state.offline:  # its node may be leaving: the trajectory moves
                self._left_node(traj.trajectory_id)
            nxt = traj.steps[pend.step + 1]
            self._push(now + nxt.think_s, SUBMIT, (pend.traj, pend.step + 1, None))
        else:
            self.state.close_trajectory(traj.trajectory_id)
            self.sandboxes.discard(traj.trajectory_id)
            self.result.trajectory_end_s[traj.trajectory_id] = now
