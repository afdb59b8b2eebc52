"""`tangram-fast`: the paper's objective at a fraction of the decision cost.

Same decision problem as `tangram-dp` (FCFS candidates, drop-tail, completion-heap estimate),
solved differently where the cost is:

- Candidates: one pass over the queue with per-NUMA-group free lists instead of placing each
  action on a copied `ClusterState` (which scans every core per action). Elastic actions go
  to the NUMA group with the most free cores (room to grow), rigid ones best-fit; the paper
  best-fits everything, which parks a 32-way test suite in the fullest group.
- Units: greedy marginal gain instead of the O(n * R * m) DP. For durations that are convex
  and decreasing in the units (Amdahl, and any concave speed-up), giving the next core to the
  candidate whose duration drops most is exactly optimal for the sum of durations
  (separable convex resource allocation), so it matches the DP's choice.
- Drop-tail: incremental. Dropping the tail candidate returns its cores to the greedy heap,
  which continues where it stopped (still exact), instead of a new DP per step.
- GPU: residency first (see `gpu_aware`): a call goes to a free chunk where its service is
  resident, at any allowed size, before anything forces a restore; then the buddy DP.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence

from scheduler.eviction import Evictions
from scheduler.execution import ExecutionModel, TimeShareSpec
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies.base import register
from scheduler.policies.common import PoolKey, waiting
from scheduler.policies.defer import defer_for_cores
from scheduler.policies.elastic import (
    Decision,
    Known,
    PoolProblem,
    cpu_decision,
    cpu_free_ids,
    elastic_round,
)
from scheduler.policies.fcfs_min import fcfs_prefix
from scheduler.policies.gpu_aware import gpu_candidates, residency_gpu_solver
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
    groups = _LazyGroups(state)
    mem_free: dict[str, int] = {}
    pins: dict[str, str] = {}
    held_now: dict[str, int] = {}  # memory reserved this pass for trajectories it pinned or grew
    picked: list[Allocation] = []
    pools: list[PoolKey | None] = []
    actions: list[QueuedAction] = []
    gpu: list[QueuedAction] = []
    api: list[QueuedAction] = []
    no_memory = False
    waiting_for_memory: set[str] = set()  # trajectories whose earlier action waits for memory
    ev: Evictions | None = None
    blocked = False  # a CPU action did not fit: no CPU action behind it starts (FCFS)
    cpu_kind, gpu_kind = ResourceKind.CPU, ResourceKind.GPU
    pinned = state.trajectory_node
    walk = _Walk(queue, state)
    for action in walk:
        kind = action.cost.key
        if kind is not cpu_kind:
            (gpu if kind is gpu_kind else api).append(action)
            continue
        options = action.cost.units.units
        units = options[0]
        elastic = len(options) > 1
        tid = action.trajectory_id
        sandbox = action.cost.sandbox
        if sandbox and waiting_for_memory and tid in waiting_for_memory:
            continue
        node = (pinned.get(tid) or pins.get(tid)) if sandbox else None
        gi = -1
        evict: tuple[str, ...] = ()
        if node is not None:
            gi = _best_group(groups[node], units, elastic) if node in state.cpu else -1
            held = held_now.get(tid)
            if held is None and node in state.cpu:
                held = state.cpu[node].trajectory_memory_mb.get(tid, 0)
            extra = action.cost.memory_mb - held if sandbox and held is not None else 0
            if extra > 0:  # a later action asks for more memory than its trajectory holds
                if no_memory:
                    waiting_for_memory.add(tid)
                    continue
                if not mem_free:
                    mem_free.update({n: c.memory_free_mb for n, c in state.cpu.items() if c.online})
                free_mb = mem_free.get(node, 0)
                if free_mb < extra:
                    if ev is None:
                        ev = Evictions(state, queue)
                    victims = ev.victims(node, extra - free_mb) if gi >= 0 else None
                    if victims is None:
                        no_memory = True  # as for a new trajectory: the others go on
                        waiting_for_memory.add(tid)
                        walk.memory_full(action, pins)
                        continue
                    evict = victims
                    ev.take(victims)
                    mem_free[node] = 0  # the surplus is free from the next round on
                elif gi >= 0:
                    mem_free[node] = free_mb - extra
                held_now[tid] = action.cost.memory_mb
        elif no_memory and sandbox:
            continue  # a new trajectory before it waits for memory: no overtaking among new ones
        else:
            if not mem_free:
                mem_free.update({n: c.memory_free_mb for n, c in state.cpu.items() if c.online})
            need = action.cost.memory_mb if sandbox else 0
            order = mem_free if len(mem_free) == 1 else sorted(mem_free, key=lambda n: (-mem_free[n], n))
            for name in order:
                if mem_free[name] < need:
                    break
                gi = _best_group(groups[name], units, elastic)
                if gi >= 0:
                    node = name
                    if sandbox:
                        pins[tid] = name
                        held_now[tid] = need
                        mem_free[name] -= need
                    break
            if node is None and sandbox and need > 0:
                if ev is None:
                    ev = Evictions(state, queue)
                for name in order:  # the nodes with the cores, most free memory first
                    short_mb = need - mem_free[name]
                    if short_mb <= 0:
                        continue  # it has the memory: cores are what it lacks
                    g = _best_group(groups[name], units, elastic)
                    victims = ev.victims(name, short_mb) if g >= 0 else None
                    if victims is not None:
                        node, gi, evict = name, g, victims
                        ev.take(victims)
                        pins[tid] = name
                        held_now[tid] = need
                        mem_free[name] = 0  # the surplus is free from the next round on
                        break
            if node is None and max(mem_free.values(), default=0) < need:
                no_memory = True  # see `fcfs_prefix`: pinned trajectories behind it go on
                walk.memory_full(action, pins)
                continue
        if gi < 0 or node is None:
            blocked = True
            break
        free = groups[node][gi]
        ids = tuple(free[:units])
        del free[:units]
        picked.append(Allocation(action.action_id, cpu_kind, node, units, ids, evict))
        pools.append(("cpu", node, gi))
        actions.append(action)
    if blocked and (state.gpu or state.api):  # no CPU action passes it (FCFS); GPU and API
        tail = list(walk)  # ones behind it go on
        if state.gpu:
            gpu += [a for a in tail if a.cost.key is gpu_kind]
        if state.api:
            api += [a for a in tail if a.cost.key is not gpu_kind and a.cost.key is not cpu_kind]
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


def greedy_cpu_solver(problem: PoolProblem) -> Decision:
    """Drop-tail over greedy marginal-gain allocations of one NUMA group's free cores.

    Incremental: dropping the tail candidate returns its cores, and the greedy heap goes on
    from where it stopped. Heap entries popped earlier because their step did not fit are put
    back, so the heap holds exactly each kept candidate's next step, as if rebuilt.
    """
    members, now_s = problem.members, problem.now_s
    ids = cpu_free_ids(problem)
    free = len(ids)
    actions = [a for a, _ in members]
    units = [a.cost.units.min for a in actions]
    durs = [a.duration_s(u) for a, u in zip(actions, units, strict=True)]
    left = free - sum(units)
    keep = len(actions)
    heap: list[tuple[float, int, int, float]] = []
    for i in range(keep):
        if len(actions[i].cost.units.units) > 1:  # a rigid one has no next step
            _push(heap, actions[i], i, units[i], durs[i], free)
    skipped: list[tuple[float, int, int, float]] = []
    pop = heapq.heappop

    def fill() -> None:
        nonlocal left
        while left > 0 and heap:
            entry = pop(heap)
            i, nxt = entry[1], entry[2]
            if i >= keep or nxt <= units[i]:
                continue
            step = nxt - units[i]
            if step > left:
                skipped.append(entry)
                continue
            units[i] = nxt
            durs[i] = entry[3]
            left -= step
            _push(heap, actions[i], i, nxt, entry[3], free)

    def objective() -> float:
        kept = durs[:keep]
        ends = [(now_s + d, u) for d, u in zip(kept, units, strict=False)]
        wait = waiting(actions[keep:]) + problem.rest
        return sum(kept) + problem.rest_estimate_s(ends, wait)

    fill()
    best = (objective(), keep, list(units), list(durs))
    while keep > 1:
        keep -= 1
        left += units[keep]
        for entry in skipped:
            if entry[1] < keep:
                heapq.heappush(heap, entry)
        skipped.clear()
        fill()
        obj = objective()
        if obj >= best[0]:
            break
        best = (obj, keep, list(units), list(durs))
    keep, units, durs = best[1], best[2], best[3]
    if problem.defer:
        keep, units = defer_for_cores(problem, keep, units, durs, free)
    return cpu_decision(problem, keep, units, ids)


def _push(
    heap: list[tuple[float, int, int, float]], action: QueuedAction, i: int, cur: int, cur_s: float, cap: int
) -> None:
    """Push the candidate's next unit step keyed by its duration gain per extra unit.

    `cur_s` is its duration at `cur` units; the entry carries the duration at the next step.
    """
    for nxt in action.cost.units.units:
        if nxt > cur:
            if nxt > cap:
                return
            nxt_s = action.duration_s(nxt)
            gain = (cur_s - nxt_s) / (nxt - cur)
            if gain > 0:
                heapq.heappush(heap, (-gain, i, nxt, nxt_s))
            return


@register("tangram-fast")
class TangramFast:
    """Our policy: `tangram-dp`'s decisions by greedy marginal gain. `depth` as in Algorithm 2.

    `lend`: spare cores are lent to running malleable actions (`scheduler.policies.malleable`);
    `warm`: GPU services are restored onto free GPU memory ahead of demand
    (`scheduler.policies.warm_gpu`); `share`: short rigid CPU actions time-share cores held by
    a running action under saturation (`scheduler.policies.time_share`; True: the default
    bounds, or a `TimeShareSpec`; False: never).
    """

    name = "tangram-fast"

    def __init__(
        self,
        depth: int = 2,
        defer: bool = True,
        lend: bool = True,
        warm: bool = True,
        share: bool | TimeShareSpec = True,
    ) -> None:
        self.depth = depth
        self.defer = defer
        self.lend = lend
        self.warm = warm
        spec = TimeShareSpec() if share is True else share or None
        self.share = spec
        self.execution = ExecutionModel(lend_cores=lend, warm_gpu=warm, time_share=spec)

    def decide(self, queue: Sequence[QueuedAction], state: ClusterState, now_s: float) -> list[Allocation]:
        cands, known = fast_candidates(queue, state, now_s)
        return elastic_round(
            queue, state, now_s, cands, greedy_cpu_solver, residency_gpu_solver, self.depth, self.defer, known
        )
