"""The fast paths of a scheduling round compute exactly what the plain algorithms compute.

`rest_estimate_s` keeps one end time per busy unit in a float heap, with a heapreplace fast
path; Algorithm 2 as written pops whole (end, units) allocations. `greedy_cpu_solver` continues
its marginal-gain heap across drop-tail steps instead of rebuilding it. Both must give the same
numbers, bit for bit, as the straightforward versions below, on random cases.
"""

from __future__ import annotations

import heapq
import random

import pytest

from scheduler.duration import Amdahl
from scheduler.model import Allocation, CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.policies.common import Busy, Waiting, rest_estimate_s, waiting
from scheduler.policies.elastic import PoolProblem
from scheduler.policies.tangram_fast import greedy_cpu_solver
from scheduler.resources import ClusterState, CpuNode


def reference_rest_estimate_s(
    now_s: float, capacity: int, busy: list[Busy], rest: list[Waiting], depth: int
) -> float:
    """Algorithm 2 as written: a heap of (end, units) allocations, popped whole."""
    heap = list(busy)
    heapq.heapify(heap)
    free = capacity - sum(u for _, u in busy)
    t_s, total_s = now_s, 0.0
    for i, (units, dur_s, action) in enumerate(rest):
        if units > capacity:
            continue
        options = [units]
        if i == 0 and depth > 1 and len(action.cost.units.units) > 1:
            options = [u for u in action.cost.units.units if u <= capacity][:depth]
        best = None
        for u in options:
            h, f, t = list(heap), free, t_s
            while f < u and h:
                end_s, n = heapq.heappop(h)
                t, f = max(t, end_s), f + n
            end_s = t + action.duration_s(u) if u != units or len(options) > 1 else t + dur_s
            if best is None or end_s < best[0]:
                best = (end_s, u, h, f, t)
        assert best is not None
        end_s, units, heap, free, t_s = best
        heapq.heappush(heap, (end_s, units))
        free -= units
        total_s += end_s - now_s
    return total_s


def _action(rng: random.Random, i: int, max_units: int) -> QueuedAction:
    lo = rng.randint(1, max_units)
    r = rng.random()
    if r < 0.4:
        units = Elastic.fixed(lo)
    elif r < 0.7:
        units = Elastic.range(lo, rng.randint(lo, max_units + 2))
    else:  # a discrete set with gaps: steps of several units, which may not fit what is left
        units = Elastic((lo, *rng.sample(range(lo + 1, lo + 10), rng.randint(1, 3))))
    cost = CostVector(ResourceKind.CPU, units, memory_mb=1)
    t1_s = rng.choice([1.0, 2.0, rng.lognormvariate(1.0, 1.0)])  # repeated values: ties
    return QueuedAction(f"a{i}", f"t{i}", cost, 0.0, t1_s=t1_s, efficiency=Amdahl(rng.random()))


@pytest.mark.parametrize("seed", range(300))
def test_rest_estimate_matches_algorithm_2_as_written(seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.randint(1, 16)
    now_s = rng.uniform(0.0, 100.0)
    busy: list[Busy] = []
    used = 0
    while used < capacity and rng.random() < 0.8:
        u = rng.randint(1, capacity - used)
        busy.append((now_s + rng.choice([0.0, 1.0, rng.uniform(0.0, 50.0)]), u))
        used += u
    rest = waiting(_action(rng, i, capacity + 1) for i in range(rng.randint(0, 40)))
    depth = rng.randint(1, 3)
    got = rest_estimate_s(now_s, capacity, busy, rest, depth)
    assert got == reference_rest_estimate_s(now_s, capacity, busy, rest, depth)


def _cpu_problem(rng: random.Random, cores: int) -> PoolProblem:
    state = ClusterState(cpu={"n0": CpuNode.uniform("n0", cores, 10**9, 1)})
    members = []
    left = cores
    i = 0
    spare = min(cores - 1, rng.choice([0, 0, 1, 3]))  # cores nobody takes at the minimum
    while left > spare:
        action = _action(rng, i, min(4, left - spare))
        units = action.cost.units.min
        ids = tuple(range(cores - left, cores - left + units))
        members.append((action, Allocation(action.action_id, ResourceKind.CPU, "n0", units, ids)))
        left -= units
        i += 1
    rest = waiting(_action(rng, 1000 + j, 3) for j in range(rng.randint(0, 30)))
    return PoolProblem(("cpu", "n0", 0), members, state, 0.0, [], rest, depth=2, defer=False)


def reference_greedy_units(problem: PoolProblem) -> tuple[int, list[int]]:
    """Drop-tail over marginal-gain splits, searching every kept candidate's next step anew
    each time (a dropped candidate's cores go to the others, who keep what they had)."""
    actions = [a for a, _ in problem.members]
    free = len(problem.state.cpu["n0"].free)
    units = [a.cost.units.min for a in actions]
    left = free - sum(units)
    best = None
    for keep in range(len(actions), 0, -1):
        if keep < len(actions):
            left += units[keep]
        while left > 0:
            steps = []
            for i in range(keep):
                nxt = [u for u in actions[i].cost.units.units if u > units[i]]
                if nxt and nxt[0] - units[i] <= left and nxt[0] <= free:
                    a = actions[i]
                    gain = (a.duration_s(units[i]) - a.duration_s(nxt[0])) / (nxt[0] - units[i])
                    if gain > 0:
                        steps.append((-gain, i, nxt[0]))
            if not steps:
                break
            _, i, nxt_u = min(steps)
            left -= nxt_u - units[i]
            units[i] = nxt_u
        durs = [actions[i].duration_s(units[i]) for i in range(keep)]
        ends = [(d, u) for d, u in zip(durs, units, strict=False)]
        rest = waiting(actions[keep:]) + problem.rest
        obj = sum(durs) + rest_estimate_s(0.0, problem.capacity, ends, rest, problem.depth)
        if best is not None and obj >= best[0]:
            break
        best = (obj, keep, list(units))
    assert best is not None
    return best[1], best[2]


@pytest.mark.parametrize("seed", range(150))
def test_incremental_drop_tail_matches_a_rebuilt_greedy(seed: int) -> None:
    rng = random.Random(seed)
    problem = _cpu_problem(rng, rng.randint(2, 24))
    keep, units = reference_greedy_units(problem)
    decided = greedy_cpu_solver(problem)
    got = [decided[a.action_id] for a, _ in problem.members]
    want = [units[i] if i < keep else None for i in range(len(problem.members))]
    assert [a.units if a is not None else None for a in got] == want
