"""Short CPU actions in batches: riders that run one after another on an allocation's cores.

Starting one action costs the live service a round, a Celery message, a claim and a completion:
a few ms of the same cores the actions run on, and the cores an action frees idle until the
next one arrives. For actions that take ms themselves (one program against its tests, a rule
verifier), that is as much as the work: under saturation half of the cores' time went to it.
So while actions wait that no free core can take, each allocation of a short CPU action takes
along short waiting actions that would run on its node next: the worker runs them back to back
on the allocation's cores, from one message, and the cores come back when the last ends
(`ClusterState.share`). A rider's trajectory is pinned and its memory reserved at dispatch, as
for any CPU action, by eviction of idle trajectories when memory is short.

Which actions ride, walking the waiting queue in its (fair, else FCFS) order:
- short: measured (`DurationEstimator.observed_s`, no prior) to take at most `max_action_s`
  at the leader's unit count, which it must accept; a kind not yet measured never rides;
- an action handed back from a batch (`QueuedAction.solo`: the live worker gives back the
  riders behind an action that overran) never rides again: it goes alone, so it cannot be
  handed back twice;
- a batch holds at most `max_actions` actions and `max_batch_s` of expected work; a rider goes
  to the batch of its node expected to end first; an action whose trajectory's previous action
  starts in a batch this round may only follow it there (never beside it);
- a batch already running whose cores have at most `join_below` actions left (the running one
  included) takes riders too, queued behind them on its cores: the next batch is on its way
  while the last actions of this one run, instead of the cores idling through the round, the
  message and the claim that start it after the last one ended. So does a short action (one
  that could lead a batch when it started) running alone on its cores: the first of a burst,
  started by the round that saw only it;
- when few short actions are left to place, no batch takes more than its share of them: the
  actions waiting and those left on every busy core group, spread evenly over those groups.
  Riders are committed to cores; without this, the batch that joined first took the last ones
  up to `max_actions`, and at the end of a burst the other cores idled while it worked through
  them (every caller that waits for its whole burst, a training step, waits for that core);
- FCFS holds for every action that competes for the same cores: the walk closes a node at the
  first action that could run there next but cannot ride (too long, another unit count, no
  batch with room, no memory even by eviction), so nothing overtakes it. Actions that could
  not start now anyway (their trajectory has an action running or starting, or they are pinned
  to a node with no batch this round) and actions of other resources do not close a node.

Pure: reads the queue and the state, changes neither; `scheduler.round` calls it after the
policy, the simulator and the live service carry the riders out. Riders are not malleable
borrowers (`scheduler.policies.malleable`) while they wait for their turn.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from scheduler.eviction import Evictions
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState

Observed = Callable[[QueuedAction, int], float | None]
"""(action, units) -> seconds its kind was measured to take at that unit count, None if unknown."""


@dataclass(frozen=True, slots=True)
class CpuBatchSpec:
    """Bounds of one batch: `max_actions` (leader included), `max_action_s` for each action,
    `max_batch_s` of expected work in all (seconds, as measured); a running batch with at most
    `join_below` actions left on its cores takes riders behind them (below 2: never)."""

    max_actions: int = 8
    max_action_s: float = 0.05
    max_batch_s: float = 0.2
    join_below: int = 2

    def __post_init__(self) -> None:
        if self.max_actions < 1 or self.max_action_s <= 0 or self.max_batch_s <= 0 or self.join_below < 0:
            raise ValueError(f"bad CPU batch bounds: {self}")

    @property
    def joins(self) -> bool:
        """Do running batches take riders behind them? (A batch is an action with a rider at
        least, so it takes `join_below` 2 and batches of 2 or more.)"""
        return self.join_below >= 2 and self.max_actions >= 2


@dataclass(slots=True)
class _Batch:
    lead: Allocation
    work_s: float  # expected work queued on its cores, the leader's included
    size: int = 1


def cpu_riders(
    allocs: Iterable[Allocation],
    order: Iterable[QueuedAction],
    queue: WaitingQueue,
    state: ClusterState,
    spec: CpuBatchSpec,
    observed: Observed,
    now_s: float,
    short: Iterable[str] = (),
) -> list[Allocation]:
    """The riders of this round's short CPU allocations and of running batches near their end,
    in the order they run per batch (see the module doc). `order` is the waiting queue in the
    order the round considered it; `short` names the running actions that were short leads when
    they started (`short_leads` of earlier rounds, in start order): one alone on its cores takes
    riders."""
    allocs = list(allocs)
    by_node: dict[str, list[_Batch]] = {}
    for a, d in short_leads(allocs, queue, spec, observed):
        by_node.setdefault(a.pool, []).append(_Batch(a, d))
    for b in ending_batches(state, spec, short):
        by_node.setdefault(b.lead.pool, []).append(b)
    if not by_node:
        return []
    work, started, starting, chained = _after_allocs(allocs, queue, state, by_node, now_s)
    evictions = Evictions(work, queue)
    cap = _fair_share(allocs, queue, state, spec)
    open_nodes = set(by_node)
    out: list[Allocation] = []
    for qa in order:
        if not open_nodes:
            break
        if qa.cost.key is not ResourceKind.CPU or qa.action_id in started:
            continue
        tid = qa.trajectory_id
        if tid in chained:  # its trajectory's previous action is in a batch: it may follow there
            batch = chained[tid]
            rider = (
                _ride(qa, [batch], work, evictions, spec, observed, cap)
                if batch.lead.pool in open_nodes
                else None
            )
            if rider is not None:
                _add(rider, qa, batch, work, evictions, out, now_s)
            continue  # else it waits for that action to end, as it would anyway
        if tid in starting or tid in work.trajectory_running:
            continue  # waits for its trajectory's running action, wherever it is
        pinned = work.trajectory_node.get(tid) if qa.cost.sandbox else None
        if pinned is not None and pinned not in open_nodes:
            continue  # it competes for another node's cores only
        nodes = (
            [pinned] if pinned is not None else sorted(open_nodes, key=lambda n: -work.cpu[n].memory_free_mb)
        )
        seat = _seat(qa, nodes, by_node, work, evictions, spec, observed, cap)
        if seat is None:
            open_nodes.difference_update(nodes)  # FCFS: nothing overtakes it there
            continue
        rider, batch = seat
        _add(rider, qa, batch, work, evictions, out, now_s)
        chained[tid] = batch
    return out


def _after_allocs(
    allocs: list[Allocation],
    queue: WaitingQueue,
    state: ClusterState,
    by_node: dict[str, list[_Batch]],
    now_s: float,
) -> tuple[ClusterState, set[str], set[str], dict[str, _Batch]]:
    """The state as it will be once this round's allocations are applied (their pins, memory
    and evictions count before the riders'), with the actions they start, their trajectories,
    and the trajectories whose next action may follow on a batch's cores (one of theirs leads
    it; not when two of theirs start)."""
    work = state.copy()
    started: set[str] = set()
    starting: set[str] = set()  # trajectories with an action starting this round
    chained: dict[str, _Batch] = {}  # ... on the cores of this batch (its next action may follow)
    batch_of = {b.lead.action_id: b for batches in by_node.values() for b in batches}
    twice: set[str] = set()  # trajectories with two actions starting: none may follow either
    for a in allocs:
        qa = queue.action(a.action_id)
        tid = qa.trajectory_id
        started.add(a.action_id)
        if tid in starting:
            twice.add(tid)
        starting.add(tid)
        if a.action_id in batch_of:
            chained[tid] = batch_of[a.action_id]
        if a.kind is ResourceKind.CPU:
            work.apply(a, qa, now_s)
    for tid in twice:
        chained.pop(tid, None)
    return work, started, starting, chained


def _seat(
    qa: QueuedAction,
    nodes: list[str],
    by_node: dict[str, list[_Batch]],
    work: ClusterState,
    evictions: Evictions,
    spec: CpuBatchSpec,
    observed: Observed,
    cap: int,
) -> tuple[Allocation, _Batch] | None:
    """`qa`'s seat behind a batch on one of `nodes` (in order; on a node, the batch with the least
    work first), or None."""
    for node in nodes:
        for batch in sorted(by_node[node], key=lambda b: b.work_s):
            rider = _ride(qa, [batch], work, evictions, spec, observed, cap)
            if rider is not None:
                return rider, batch
    return None


def short_leads(
    allocs: Iterable[Allocation], queue: WaitingQueue, spec: CpuBatchSpec, observed: Observed
) -> list[tuple[Allocation, float]]:
    """The CPU allocations that may lead a batch (measured short at their unit count), each with
    its measured seconds."""
    if spec.max_actions < 2:
        return []
    out = []
    for a in allocs:
        if a.kind is not ResourceKind.CPU or not a.unit_ids:
            continue
        d = observed(queue.action(a.action_id), a.units)
        if d is not None and d <= spec.max_action_s:
            out.append((a, d))
    return out


def _fair_share(
    allocs: list[Allocation], queue: WaitingQueue, state: ClusterState, spec: CpuBatchSpec
) -> int:
    """The most actions a batch may hold this round: `max_actions`, or, when few CPU actions
    wait, their share: the waiting ones and those left on each busy core group (an action
    running or starting there, and the riders queued behind it), spread evenly over the
    groups, rounded up. Counting stops once the queue is long enough for `max_actions` to
    bind (or after a few times that many entries, most of them of other resources: then no
    cap), so a long queue costs nothing here."""
    left: dict[tuple[str, tuple[int, ...]], int] = {}
    starting = 0  # this round's CPU allocations, still in the queue
    for a in state.running.values():
        if a.kind is ResourceKind.CPU and not a.shares and a.unit_ids:
            node = state.cpu.get(a.pool)
            left[(a.pool, a.unit_ids)] = 1 + (node.riders.get(a.unit_ids, 0) if node else 0)
    for a in allocs:
        if a.kind is ResourceKind.CPU and a.unit_ids:
            left[(a.pool, a.unit_ids)] = left.get((a.pool, a.unit_ids), 0) + 1
            starting += 1
    if not left:
        return spec.max_actions
    enough = len(left) * spec.max_actions  # as many as the groups could take: no cap
    busy = sum(left.values())
    waiting = -starting
    for n, qa in enumerate(queue):
        if n >= 4 * enough + len(allocs):
            return spec.max_actions  # mostly other resources' actions: leave it uncapped
        if qa.cost.key is ResourceKind.CPU:
            waiting += 1
            if waiting + busy >= enough:
                return spec.max_actions
    return min(spec.max_actions, -(-(max(waiting, 0) + busy) // len(left)))


def ending_batches(state: ClusterState, spec: CpuBatchSpec, short: Iterable[str] = ()) -> list[_Batch]:
    """Running batches that may take riders behind them: cores held by a batch (an action with
    riders queued behind it) with at most `spec.join_below` actions left, on a node that is not
    offline. Each as a `_Batch` led by one of those actions, `size` the actions left; its work
    counts only what queues behind them (the actions left are short: measured so when they
    joined, while their expected ends follow the estimates, which a prior can make far longer).

    Then each running action of `short` (those measured short when they started) that runs
    alone on its cores (no riders, no time sharers): the first action of a burst, which the
    round that saw only it started alone before the rest arrived. Without riders queued behind
    it, its cores idled from its end through the next round, message and claim while the rest
    of the burst waited (docs/scheduling.md, "The start of a burst"). Only `short` is walked
    for these, not every running action."""
    if not spec.joins:
        return []
    ending: dict[tuple[str, tuple[int, ...]], int] = {}
    for name, node in state.cpu.items():
        if not node.online:
            continue
        for ids, riders in node.riders.items():
            if riders + 1 <= spec.join_below:
                ending[(name, ids)] = riders + 1
    out: dict[tuple[str, tuple[int, ...]], _Batch] = {}
    if ending:
        for a in state.running.values():
            key = (a.pool, a.unit_ids)
            if key in ending and key not in out and a.kind is ResourceKind.CPU and not a.shares:
                out[key] = _Batch(a, 0.0, ending[key])
    for aid in short:
        lone = state.running.get(aid)
        if lone is None or lone.kind is not ResourceKind.CPU or lone.shares or not lone.unit_ids:
            continue
        key = (lone.pool, lone.unit_ids)
        if key not in out and _alone(state, lone):
            out[key] = _Batch(lone, 0.0, 1)
    return list(out.values())


def _alone(state: ClusterState, a: Allocation) -> bool:
    """Is `a` alone on its cores (no riders, no time sharers, not itself a rider), on a node
    that is not offline?"""
    node = state.cpu.get(a.pool)
    if node is None or not node.online or a.unit_ids in node.riders or a.action_id in state.shared:
        return False
    return not (node.sharers and any(node.sharers.get(c) for c in a.unit_ids))


def _add(
    rider: Allocation,
    qa: QueuedAction,
    batch: _Batch,
    work: ClusterState,
    evictions: Evictions,
    out: list[Allocation],
    now_s: float,
) -> None:
    work.share(rider, qa, now_s)
    evictions.take(rider.evict)
    out.append(rider)


def _ride(
    qa: QueuedAction,
    batches: list[_Batch],
    work: ClusterState,
    evictions: Evictions,
    spec: CpuBatchSpec,
    observed: Observed,
    cap: int,
) -> Allocation | None:
    """A rider allocation for `qa` on the first of `batches` with room for it (counted in
    that batch: at most `cap` actions, `_fair_share`), or None."""
    if qa.solo:
        return None  # handed back from a batch once: it goes alone (and nothing overtakes it)
    for b in batches:
        units = b.lead.units
        if b.size >= cap or units not in qa.cost.units.units:
            continue
        d = observed(qa, units)
        if d is None or d > spec.max_action_s or b.work_s + d > spec.max_batch_s:
            continue
        node = b.lead.pool
        short_mb = work.memory_extra_mb(qa) - work.cpu[node].memory_free_mb
        victims = evictions.victims(node, short_mb)
        if victims is None:
            return None  # no batch of this node helps
        b.size += 1
        b.work_s += d
        return Allocation(qa.action_id, ResourceKind.CPU, node, units, b.lead.unit_ids, victims)
    return None
