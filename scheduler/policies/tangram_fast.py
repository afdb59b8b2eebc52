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
from bisect import bisect_right
from collections.abc import Sequence

from scheduler.execution import ExecutionModel, TimeShareSpec
from scheduler.model import Allocation, QueuedAction
from scheduler.policies.base import register
from scheduler.policies.common import waiting
from scheduler.policies.defer import defer_for_cores
from scheduler.policies.elastic import (
    Decision,
    PoolProblem,
    cpu_decision,
    cpu_free_ids,
    elastic_round,
)
from scheduler.policies.fast_candidates import fast_candidates
from scheduler.policies.gpu_aware import residency_gpu_solver
from scheduler.resources import ClusterState


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
    options = action.cost.units.units  # ascending (`Elastic`): the next step by bisection
    j = bisect_right(options, cur)
    if j == len(options):
        return
    nxt = options[j]
    if nxt > cap:
        return
    nxt_s = action.duration_s(nxt)
    gain = (cur_s - nxt_s) / (nxt - cur)
    if gain > 0:
        heapq.heappush(heap, (-gain, i, nxt, nxt_s))


@register("tangram-fast")
class TangramFast:
    """Our policy: `tangram-dp`'s decisions by greedy marginal gain. `depth` as in Algorithm 2.

    `lend`: spare cores are lent to running malleable actions (`scheduler.policies.malleable`);
    `warm`: GPU services are restored onto free GPU memory ahead of demand
    (`scheduler.policies.warm_gpu`); `share`: short rigid CPU actions time-share cores held by
    a running action under saturation (`scheduler.policies.time_share`; True: the default
    bounds, or a `TimeShareSpec`; False: never). New trajectories in an image go where their
    image is soonest (`scheduler.policies.image_places`), and the images of queued ones are
    fetched ahead (`scheduler.round.fetch`).
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
        self.execution = ExecutionModel(lend_cores=lend, warm_gpu=warm, time_share=spec, fetch_images=True)

    def decide(self, queue: Sequence[QueuedAction], state: ClusterState, now_s: float) -> list[Allocation]:
        cands, known = fast_candidates(queue, state, now_s)
        return elastic_round(
            queue, state, now_s, cands, greedy_cpu_solver, residency_gpu_solver, self.depth, self.defer, known
        )
