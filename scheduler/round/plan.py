"""The scheduling round: `Round` wraps a policy, `Round.plan` returns a `RoundPlan`.

The steps and their order are in the package's doc (`scheduler.round`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from scheduler.execution import GpuResidency, execution_of
from scheduler.fairshare import order_queue
from scheduler.gpu_cache import GpuCache, GpuLoad
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies.base import Policy
from scheduler.policies.cpu_batch import CpuBatchSpec, Observed, cpu_riders, short_leads
from scheduler.policies.malleable import Borrower, Lent, lend_cores
from scheduler.policies.time_share import HostCache, time_sharers
from scheduler.policies.warm_gpu import GpuDemand, Instance, oversized, warm_placements
from scheduler.pools import CpuNode
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState

MaxBatch = Callable[[str], int]  # GPU service -> largest batch one call scores


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
    taken back); `decision_s`: seconds the fair ordering and the policy took (with the loans,
    sharers and warm placements, when it made any).
    """

    allocs: list[Allocation] = field(default_factory=list)
    riders: list[Allocation] = field(default_factory=list)
    sharers: list[Allocation] = field(default_factory=list)
    evicted: dict[str, str] = field(default_factory=dict)
    gpu_loads: dict[str, GpuLoad] = field(default_factory=dict)
    lends: Lent = field(default_factory=dict)
    warm: list[GpuLoad] = field(default_factory=list)
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
        self.lent: Lent = {}  # borrower -> (node, cores lent to it), kept by `plan`
        self._on_loan: dict[str, int] = {}  # node -> cores on loan there (`_loan`)
        self._borrowers: dict[str, Borrower] = {}  # running malleable actions (when lending)
        # the same by node, in the same order: a round looks at nodes, not at every borrower
        self._borrower_nodes: dict[str, dict[str, Borrower]] = {}
        # each node's state (object, version) when its borrowers were last looked at: a node
        # whose version has not moved has had no action end since
        self._borrowers_seen: dict[str, tuple[CpuNode, int]] = {}
        # nodes where no borrower gains from a core (each at its largest unit count or no
        # faster with one more): so until an allocation or a take-back there changes them
        self._saturated: set[str] = set()
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

    def plan(self, queue: WaitingQueue, state: ClusterState, now_s: float) -> RoundPlan:
        """Decide one round over `queue` (FCFS) on `state`; neither is changed."""
        t0 = time.perf_counter()
        ordered = self.order(queue, state, now_s)
        allocs = one_per_sandbox(self.policy.decide(ordered, state, now_s), queue, state)
        out = RoundPlan(allocs, decision_s=time.perf_counter() - t0)
        if self.execution.lend_cores:
            out.lends = self.lend(allocs, queue, state, now_s)
        if allocs and self.max_batch is not None:
            out.riders = riders(allocs, queue, self.max_batch)
        if self.cpu_batch is not None and self.observed is not None:
            # riders of this round's allocations, or queued behind a batch near its end (or
            # behind a short action alone on its cores: the first of a burst)
            self._short_leads = {aid: None for aid in self._short_leads if aid in state.running}
            cpu = cpu_riders(
                allocs,
                ordered,
                queue,
                state,
                self.cpu_batch,
                self.observed,
                now_s,
                self._short_leads,
            )
            for a, _ in short_leads(allocs, queue, self.cpu_batch, self.observed):
                self._short_leads[a.action_id] = None
            if cpu:
                out.riders += cpu
                out.decision_s = time.perf_counter() - t0
        share = self.execution.time_share
        if share is not None and self.observed is not None and state.cpu:
            out.sharers = time_sharers(
                out.started, ordered, queue, state, share, self.observed, now_s, self._hosts
            )
            out.decision_s = time.perf_counter() - t0
        if self.execution.warm_gpu and state.gpu:
            out.warm = self.warm(out.started, queue, state, now_s)
        if out.lends or out.warm:
            out.decision_s = time.perf_counter() - t0  # loans and placements are decisions too
        if not out.started:
            return out
        if self.fair is not None:
            for a in out.started:
                self._job_of[a.action_id] = queue.action(a.action_id).job_id
        for a in out.started:
            for tid in a.evict:
                out.evicted[tid] = a.pool
        if state.gpu_cache and self.execution.gpu_residency is not GpuResidency.NONE:
            out.gpu_loads = gpu_loads(allocs, queue, state, now_s, self.execution.gpu_residency)
        return out

    def lend(self, allocs: list[Allocation], queue: WaitingQueue, state: ClusterState, now_s: float) -> Lent:
        """Take lent cores back where `allocs` need them, lend the spare ones (see
        `scheduler.policies.malleable`); updates `lent` and returns the changed loans."""
        borrowers = self._borrowers
        lent = self.lent
        self._drop_ended(state)
        taken: dict[str, set[int]] = {}
        for a in allocs:
            if a.kind is ResourceKind.CPU:
                taken.setdefault(a.pool, set()).update(a.unit_ids)
                qa = queue.action(a.action_id)
                if qa.cost.malleable:
                    self._add_borrower(Borrower(qa, a))
        if not borrowers:
            return {}
        # Only nodes where something can change: an allocation took cores, or cores are spare
        # (free beyond those on loan) and a borrower there can use one. Lent cores are free in
        # `state` and disjoint.
        saturated = self._saturated
        saturated.difference_update(taken)
        on_loan = self._on_loan
        active = set(taken)
        for node in self._borrower_nodes:
            if node not in active and node not in saturated:
                cpu = state.cpu.get(node)
                if cpu is not None and len(cpu.free) > on_loan.get(node, 0):
                    active.add(node)
        if not active:
            return {}
        nodes = self._borrower_nodes
        changed = lend_cores(
            [b for node, on in nodes.items() if node in active for b in on.values()],
            {aid: loan for aid, loan in lent.items() if loan[0] in active},
            taken,
            state,
            now_s,
            saturated,
        )
        for aid, loan in changed.items():
            self._loan(aid, loan if loan[1] else None)
        return changed

    def _loan(self, aid: str, loan: tuple[str, frozenset[int]] | None) -> None:
        """Set (or with None, end) a borrower's loan, keeping the count per node."""
        lent, on_loan = self.lent, self._on_loan
        old = lent.get(aid)
        if old is not None:
            left = on_loan[old[0]] - len(old[1])
            if left:
                on_loan[old[0]] = left
            else:
                del on_loan[old[0]]
        if loan is None:
            lent.pop(aid, None)
        else:
            lent[aid] = loan  # (one already there keeps its place)
            on_loan[loan[0]] = on_loan.get(loan[0], 0) + len(loan[1])

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
        for qa in queue:
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
        resident = [(n, c, s) for n, g in state.gpu.items() for c, ss in g.resident.items() for s in ss]
        return oversized(state, self.demand, resident, now_s)

    def idle(self, queue: WaitingQueue, state: ClusterState, now_s: float) -> RoundPlan:
        """The round's steps that need no waiting action (loans, warm placements), for an
        executor to run when units come back and nothing waits."""
        out = RoundPlan()
        if self.execution.lend_cores:
            out.lends = self.lend([], queue, state, now_s)
        if self.execution.warm_gpu and state.gpu:
            out.warm = self.warm([], queue, state, now_s)
        return out

    def borrowers(self) -> list[Borrower]:
        """The running malleable actions loans go to (as of the last round)."""
        return list(self._borrowers.values())

    def track_malleable(self, action: QueuedAction, alloc: Allocation) -> None:
        """Count a running malleable action that no round of this object started (recovered
        after a restart) as a borrower."""
        if action.cost.malleable and alloc.kind is ResourceKind.CPU:
            self._add_borrower(Borrower(action, alloc))

    def _drop_ended(self, state: ClusterState) -> None:
        """Forget the borrowers that ended (and their loans), looking only at nodes whose
        state changed since the last round."""
        seen = self._borrowers_seen
        for node, on in list(self._borrower_nodes.items()):
            cpu = state.cpu.get(node)
            last = seen.get(node)
            if cpu is not None and last is not None and last[0] is cpu and last[1] == cpu.version:
                continue
            for aid in [aid for aid in on if aid not in state.running]:
                self._drop_borrower(aid)
                self._loan(aid, None)
            if cpu is not None:
                seen[node] = (cpu, cpu.version)

    def _add_borrower(self, b: Borrower) -> None:
        aid = b.alloc.action_id
        self._saturated.discard(b.alloc.pool)
        old = self._borrowers.get(aid)
        if old is not None and old.alloc.pool != b.alloc.pool:
            self._uncount(old.alloc.pool, aid)
        self._borrowers[aid] = b  # (one already there keeps its place: loans go in this order)
        self._borrower_nodes.setdefault(b.alloc.pool, {})[aid] = b

    def _drop_borrower(self, aid: str) -> None:
        self._uncount(self._borrowers.pop(aid).alloc.pool, aid)

    def _uncount(self, node: str, aid: str) -> None:
        on = self._borrower_nodes[node]
        del on[aid]
        if not on:
            del self._borrower_nodes[node]
            self._borrowers_seen.pop(node, None)
            self._saturated.discard(node)

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


def one_per_sandbox(allocs: list[Allocation], queue: WaitingQueue, state: ClusterState) -> list[Allocation]:
    """`allocs` without the CPU allocations of a trajectory whose sandbox is taken: by a CPU
    action of it already running, or by an earlier allocation of the round. A trajectory's
    actions run in its one sandbox one at a time, so a second one would hold its cores idle
    until the first ends (and could reach the worker first). It waits, or rides behind the
    first (`cpu_batch`). Policies place actions as if they were independent; workloads of
    agents (and every simulated scenario) submit a trajectory's next action after the last one
    ended, so this only holds back callers that submit several of a trajectory's actions at
    once."""
    out: list[Allocation] = []
    taken: set[str] = set()
    for a in allocs:
        if a.kind is ResourceKind.CPU:
            qa = queue.action(a.action_id)
            tid = qa.trajectory_id
            if qa.cost.sandbox:
                if tid in taken or (tid in state.trajectory_running and _runs_code(state, tid)):
                    continue
                taken.add(tid)
        out.append(a)
    return out


def _runs_code(state: ClusterState, tid: str) -> bool:
    """Does trajectory `tid` have a CPU action running (only asked when it runs something)?"""
    return any(
        t == tid and state.running[aid].kind is ResourceKind.CPU
        for aid, t in state.running_trajectory.items()
    )


def riders(allocs: list[Allocation], queue: WaitingQueue, max_batch: MaxBatch) -> list[Allocation]:
    """Batch reward actions: each GPU allocation takes along up to `max_batch - 1` waiting
    actions of the same service that run at the same DoP, on the same chunk (FCFS among them).

    They need no units of their own: the worker scores them in one batch with the action the
    chunk was allocated to, which is what a GPU does best. Other waiting actions lose nothing,
    since no units are taken from them."""
    leaders = [a for a in allocs if a.kind is ResourceKind.GPU]
    if not leaders:
        return []
    started = {a.action_id for a in allocs}
    room: dict[str, list[Allocation]] = {}
    for a in leaders:
        service = queue.action(a.action_id).target
        n = max_batch(service)
        if n > 1:
            room.setdefault(service, []).extend([a] * (n - 1))
    if not room:
        return []
    out: list[Allocation] = []
    gpu = ResourceKind.GPU
    for qa in queue:
        seats = room.get(qa.target) if qa.cost.key is gpu else None
        if not seats or qa.action_id in started:
            continue
        for k, lead in enumerate(seats):
            if lead.units in qa.cost.units.units:
                del seats[k]
                out.append(Allocation(qa.action_id, gpu, lead.pool, lead.units, lead.unit_ids))
                break
    return out


def gpu_loads(
    allocs: list[Allocation], queue: WaitingQueue, state: ClusterState, now_s: float, residency: GpuResidency
) -> dict[str, GpuLoad]:
    """Each GPU allocation's load, planned in order on copies of the state's caches (a restore
    may evict what an earlier one of the round loaded). Under KEEPALIVE an instance in use is
    never evicted, as its executor marks it."""
    scratch: dict[str, GpuCache] = {}
    out: dict[str, GpuLoad] = {}
    for a in allocs:
        if a.kind is not ResourceKind.GPU or a.pool not in state.gpu_cache:
            continue
        cache = scratch.get(a.pool)
        if cache is None:
            cache = scratch[a.pool] = state.gpu_cache[a.pool].copy()
        try:
            load = cache.plan(a.pool, a.unit_ids, queue.action(a.action_id).target)
        except ValueError:
            continue  # it never fits there: left to its executor (which says so)
        cache.apply(load, now_s)
        if residency is GpuResidency.KEEPALIVE:
            cache.touch(a.unit_ids, load.service, float("inf"))
        out[a.action_id] = load
    return out
