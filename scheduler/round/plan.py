"""The scheduling round: `Round` wraps a policy, `Round.plan` returns a `RoundPlan`.

The steps and their order are in the package's doc (`scheduler.round`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler.execution import GpuResidency, execution_of
from scheduler.fairshare import order_queue
from scheduler.gpu_cache import GpuLoad
from scheduler.images import ImageFetch
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies.base import Policy
from scheduler.policies.cpu_batch import CpuBatchSpec, Observed, cpu_riders, short_leads
from scheduler.policies.malleable import Borrower, Lent
from scheduler.policies.time_share import HostCache, time_sharers
from scheduler.policies.warm_gpu import GpuDemand, Instance, oversized, warm_placements
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState
from scheduler.round.fetch import has_stores, image_fetches
from scheduler.round.loans import Loans
from scheduler.round.steps import MaxBatch, gpu_loads, one_per_sandbox, riders
from scheduler.tenancy import Ledger, Tenancy


@dataclass(frozen=True, slots=True)
class FairShareSpec:
    """Fair share across jobs: `weights` per job id (default 1), one priority level gained per
    `aging_s` waited (see `scheduler.fairshare`)."""

    weights: Mapping[str, float] = field(default_factory=dict)
    aging_s: float = 60.0


@dataclass(slots=True)
class RoundPlan:
    """What one round decided, in the order to carry it out.

    `allocs`: the policy's allocations (apply each with `ClusterState.apply`); `riders`: GPU
    actions joining an allocation's chunk, then CPU actions queued on an allocation's cores,
    each batch's in the order they run (`ClusterState.share`, after the allocations, in order);
    `sharers`: CPU actions time-sharing cores held by running actions
    (`ClusterState.share_cores`, last, in order); `evicted`: idle trajectory -> the CPU node it
    is evicted from (released by the `apply` of the allocation naming it); `gpu_loads`: GPU
    allocation id -> its load (`ClusterState.load_gpu`); `lends`: borrower -> (its node, every
    core lent to it now), for the borrowers whose loan changed this round (an empty set: all
    taken back); `fetches`: images to bring onto CPU nodes, before the allocations (those
    they need, then those fetched ahead: `scheduler.round.fetch`); `decision_s`: seconds the fair ordering and the policy took (with the loans,
    sharers and warm placements, when it made any).
    """

    allocs: list[Allocation] = field(default_factory=list)
    riders: list[Allocation] = field(default_factory=list)
    sharers: list[Allocation] = field(default_factory=list)
    evicted: dict[str, str] = field(default_factory=dict)
    gpu_loads: dict[str, GpuLoad] = field(default_factory=dict)
    lends: Lent = field(default_factory=dict)
    warm: list[GpuLoad] = field(default_factory=list)
    fetches: list[ImageFetch] = field(default_factory=list)
    decision_s: float = 0.0

    @property
    def started(self) -> list[Allocation]:
        """Every allocation of the round, riders then sharers last."""
        return self.allocs + self.riders + self.sharers


class Round:
    """The scheduling round around `policy` (see the module doc).

    `fair`: fair share across jobs (None: the queue's FCFS order as it is); `max_batch`: the
    largest batch per GPU service (None: no riders); `gpu_services`: the GPU services configured,
    with their allowed chunk sizes (seeds the demand of warm placement); `cpu_batch` with
    `observed`: short CPU actions ride in batches (None: never; policies whose pods share
    cores never batch).
    """

    def __init__(
        self,
        policy: Policy,
        *,
        fair: FairShareSpec | None = None,
        max_batch: MaxBatch | None = None,
        gpu_services: Mapping[str, tuple[int, ...]] | None = None,
        cpu_batch: CpuBatchSpec | None = None,
        observed: Observed | None = None,
    ) -> None:
        self.policy = policy
        self.execution = execution_of(policy)
        self.fair = fair
        self.max_batch = max_batch
        self.cpu_batch = cpu_batch if observed is not None and not self.execution.cpu_sharing else None
        self.observed = observed
        self._job_of: dict[str, str] = {}  # running action -> its job (fair share's held units)
        self.tenancy = Tenancy()  # tenants' caps (`scheduler.tenancy`): none until the executor sets them
        self.loans = Loans()  # core loans to running malleable actions (when lending)
        self.demand = GpuDemand(dict(gpu_services or {}))  # for warm placements
        self._gpu_calls: dict[str, str] = {}  # running GPU action -> its service
        self._hosts: HostCache = {}  # time sharing: each CPU node's hosts, by its version
        # running CPU actions that could lead a batch when they started (`cpu_batch.short_leads`),
        # in start order (a dict: deterministic): one alone on its cores takes riders behind it
        # (the first of a burst)
        self._short_leads: dict[str, None] = {}

    @property
    def name(self) -> str:
        return self.policy.name

    def track(self, action: QueuedAction) -> None:
        """Count a running action that no round of this object started (recovered after a
        restart) towards its job's share."""
        if self.fair is not None:
            self._job_of[action.action_id] = action.job_id
        self.tenancy.track(action)

    def plan(self, queue: WaitingQueue, state: ClusterState, now_s: float) -> RoundPlan:
        """Decide one round over `queue` (FCFS) on `state`; neither is changed."""
        t0 = time.perf_counter()
        ordered, caps = self._capped(queue, self.order(queue, state, now_s), state, now_s)
        allocs = _kept(caps, one_per_sandbox(self.policy.decide(ordered, state, now_s), queue, state), queue)
        out = RoundPlan(allocs, decision_s=time.perf_counter() - t0)
        if self.execution.lend_cores:
            out.lends = self.lend(allocs, queue, state, now_s)
        if allocs and self.max_batch is not None:
            out.riders = _kept(caps, riders(allocs, queue, self.max_batch), queue)
        if self.cpu_batch is not None and self.observed is not None:
            cpu = self._cpu_riders(allocs, ordered, queue, state, now_s, self.cpu_batch, self.observed)
            cpu = _kept(caps, cpu, queue)
            if cpu:
                out.riders += cpu
                out.decision_s = time.perf_counter() - t0
        share = self.execution.time_share
        if share is not None and self.observed is not None and state.cpu:
            sharers = time_sharers(
                out.started, ordered, queue, state, share, self.observed, now_s, self._hosts
            )
            out.sharers = _kept(caps, sharers, queue)
            out.decision_s = time.perf_counter() - t0
        if self.execution.warm_gpu and state.gpu:
            out.warm = self.warm(out.started, queue, state, now_s)
        if self.execution.fetch_images and has_stores(state):
            out.fetches = image_fetches(out.started, queue, state, now_s)
        if out.lends or out.warm or out.fetches:
            out.decision_s = time.perf_counter() - t0  # loans and placements are decisions too
        if out.started:
            self._settle(out, queue, state, now_s)
        return out

    def _capped(
        self,
        queue: WaitingQueue,
        ordered: WaitingQueue | list[QueuedAction],
        state: ClusterState,
        now_s: float,
    ) -> tuple[WaitingQueue | list[QueuedAction], Ledger | None]:
        """The queue without the actions capped tenants may not start now, and the round's
        ledger of them (`scheduler.tenancy`); `ordered` as it is while no capped tenant waits."""
        tenancy = self.tenancy
        if tenancy.active(queue.jobs()):
            return tenancy.admit(ordered, state, now_s)
        if tenancy.held:
            tenancy.held = {}
        return ordered, None

    def _cpu_riders(
        self,
        allocs: list[Allocation],
        ordered: WaitingQueue | list[QueuedAction],
        queue: WaitingQueue,
        state: ClusterState,
        now_s: float,
        spec: CpuBatchSpec,
        observed: Observed,
    ) -> list[Allocation]:
        """Riders of this round's allocations, or queued behind a batch near its end (or behind
        a short action alone on its cores: the first of a burst); remembers the short leads."""
        self._short_leads = {aid: None for aid in self._short_leads if aid in state.running}
        cpu = cpu_riders(allocs, ordered, queue, state, spec, observed, now_s, self._short_leads)
        for a, _ in short_leads(allocs, queue, spec, observed):
            self._short_leads[a.action_id] = None
        return cpu

    def _settle(self, out: RoundPlan, queue: WaitingQueue, state: ClusterState, now_s: float) -> None:
        """What the round's starts entail: their jobs' shares, the trajectories they evict,
        the GPU loads of the allocations."""
        if self.fair is not None:
            for a in out.started:
                self._job_of[a.action_id] = queue.action(a.action_id).job_id
        tenancy = self.tenancy
        for a in out.started:
            tenancy.track(queue.action(a.action_id))
        tenancy.prune(state)
        for a in out.started:
            for tid in a.evict:
                out.evicted[tid] = a.pool
        if state.gpu_cache and self.execution.gpu_residency is not GpuResidency.NONE:
            out.gpu_loads = gpu_loads(out.allocs, queue, state, now_s, self.execution.gpu_residency)

    def warm(
        self, started: list[Allocation], queue: WaitingQueue, state: ClusterState, now_s: float
    ) -> list[GpuLoad]:
        """Learn the GPU demand of the round's calls, and decide the warm placements."""
        gpu = ResourceKind.GPU
        calls = self._gpu_calls
        for aid in [aid for aid in calls if aid not in state.running]:
            del calls[aid]
        for a in started:
            if a.kind is gpu:
                qa = queue.action(a.action_id)
                self.demand.observe(qa.target, qa.cost.units.units, now_s)
                calls[a.action_id] = qa.target
        now_calls: dict[str, int] = {}
        for service in calls.values():
            now_calls[service] = now_calls.get(service, 0) + 1
        waiting = False
        for qa in queue.unsandboxed():  # every GPU call is one (not the CPU actions)
            if qa.cost.key is gpu and qa.action_id not in calls:
                waiting = True
                now_calls[qa.target] = now_calls.get(qa.target, 0) + 1
        self.demand.concurrent(now_s, now_calls)
        return warm_placements(state, self.demand, started, waiting, now_s)

    def retire(self, state: ClusterState, now_s: float) -> list[Instance]:
        """Resident instances the load has outgrown, on free chunks: the executor unloads them
        before the round (`scheduler.policies.warm_gpu.oversized`)."""
        if not self.execution.warm_gpu or not state.gpu_cache:
            return []
        return oversized(state, self.demand, None, now_s)  # every resident instance

    def idle(self, queue: WaitingQueue, state: ClusterState, now_s: float) -> RoundPlan:
        """The round's steps that need no waiting action (loans, warm placements), for an
        executor to run when units come back and nothing waits."""
        out = RoundPlan()
        if self.execution.lend_cores:
            out.lends = self.lend([], queue, state, now_s)
        if self.execution.warm_gpu and state.gpu:
            out.warm = self.warm([], queue, state, now_s)
        return out

    @property
    def lent(self) -> Lent:
        """Borrower -> (its node, the cores lent to it), as of the last round."""
        return self.loans.lent

    def lend(self, allocs: list[Allocation], queue: WaitingQueue, state: ClusterState, now_s: float) -> Lent:
        """Take lent cores back where `allocs` need them, lend the spare ones (`Loans.lend`)."""
        return self.loans.lend(allocs, queue, state, now_s)

    def borrowers(self) -> list[Borrower]:
        """The running malleable actions loans go to (as of the last round)."""
        return self.loans.borrowers()

    def track_malleable(self, action: QueuedAction, alloc: Allocation) -> None:
        """Count a running malleable action that no round of this object started (recovered
        after a restart) as a borrower."""
        self.loans.track(action, alloc)

    def order(
        self, queue: WaitingQueue, state: ClusterState, now_s: float
    ) -> WaitingQueue | list[QueuedAction]:
        """The queue in fair order: the queue itself while at most one job waits."""
        if self.fair is None or len(queue.jobs()) <= 1:
            return queue
        job_of = self._job_of
        held: dict[str, int] = {}
        for aid, alloc in state.running.items():
            job = job_of.get(aid, "default")
            held[job] = held.get(job, 0) + alloc.units
        if len(job_of) > 4 * len(state.running) + 1024:
            self._job_of = {k: v for k, v in job_of.items() if k in state.running}
        return order_queue(queue, held, self.fair.weights, now_s, self.fair.aging_s)


def _kept(caps: Ledger | None, allocs: list[Allocation], queue: WaitingQueue) -> list[Allocation]:
    """`allocs` without the starts that take a capped tenant over its caps (all, without caps)."""
    return allocs if caps is None else caps.keep(allocs, queue.action)
