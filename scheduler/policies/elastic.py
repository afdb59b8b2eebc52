"""The elastic round shared by `tangram-dp` and `tangram-fast` (the paper's Algorithm 1).

Given the FCFS candidates already placed at their minimum units, each pool (NUMA group or GPU
node) with an elastic candidate is handed to a *pool solver*, which returns, per candidate, a
new allocation (more units) or None (dropped from the tail: it waits for the next round).
Pools without elastic candidates keep everyone at the minimum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scheduler.dp import GpuBuddy, arrange, cpu_arrange
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies.common import (
    Busy,
    PoolKey,
    Waiting,
    busy_by_pool,
    distribute_rest,
    gpu_unit_options,
    pick_gpu_chunks,
    pool_capacity,
    pool_of,
    rest_estimate_s,
    unit_heap,
    waiting,
)
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState

Member = tuple[QueuedAction, Allocation]
Decision = dict[str, Allocation | None]


@dataclass(frozen=True, slots=True)
class PoolProblem:
    """Everything a pool solver needs: the pool, its candidates (FCFS), busy units, the rest."""

    key: PoolKey
    members: list[Member]
    state: ClusterState
    now_s: float
    busy: list[Busy]
    rest: list[Waiting]
    depth: int
    defer: bool = False  # the solver may hold an elastic candidate back for more cores
    busy_heap: list[float] = field(init=False, repr=False, compare=False)  # unit_heap(busy)

    def __post_init__(self) -> None:
        object.__setattr__(self, "busy_heap", unit_heap(self.busy))

    def rest_estimate_s(self, ends: list[Busy], rest: list[Waiting]) -> float:
        """Algorithm 2's estimate for the pool with `ends` started now and `rest` queued."""
        return rest_estimate_s(self.now_s, self.capacity, ends, rest, self.depth, self.busy_heap)

    @property
    def capacity(self) -> int:
        return pool_capacity(self.key, self.state)


PoolSolver = Callable[[PoolProblem], Decision]


@dataclass(slots=True)
class Known:
    """What a candidate pass already knows of each candidate `i`: its queued action, and its
    pool (None where it did not work that out)."""

    actions: list[QueuedAction]
    pools: list[PoolKey | None]


def elastic_round(
    queue: Sequence[QueuedAction],
    state: ClusterState,
    now_s: float,
    cands: list[Allocation],
    cpu_solver: PoolSolver,
    gpu_solver: PoolSolver,
    depth: int,
    defer: bool = False,
    known: Known | None = None,
) -> list[Allocation]:
    """Re-decide the units of `cands` pool by pool; returns the allocations in FCFS order.

    `known`: what the candidate pass knows of `cands` (saves a pass over the queue when no
    candidate is elastic, the common round of a busy cluster).
    """
    if all(a.kind is ResourceKind.API for a in cands):
        return cands
    wanted = {a.action_id for a in cands}
    if known is None:
        by_id = {a.action_id: a for a in queue if a.action_id in wanted}
        known = Known([by_id[a.action_id] for a in cands], [None] * len(cands))
    members: dict[PoolKey, list[Member]] = {}
    for alloc, action, key in zip(cands, known.actions, known.pools, strict=True):
        if alloc.kind is ResourceKind.API:
            continue
        if key is None:
            key = pool_of(alloc, state)
        members.setdefault(key, []).append((action, alloc))
    elastic = {k: m for k, m in members.items() if any(a.cost.units.is_elastic for a, _ in m)}
    if not elastic:
        return cands
    rest_by_pool = distribute_rest(queue, state, list(members), skip=wanted)
    busy = busy_by_pool(state, now_s, elastic)
    decided: Decision = {}
    memo = queue.memo if isinstance(queue, WaitingQueue) else None
    for key, mem in elastic.items():
        rest_w = waiting(rest_by_pool[key], memo)
        problem = PoolProblem(key, mem, state, now_s, busy.get(key, []), rest_w, depth, defer)
        solver = cpu_solver if key[0] == "cpu" else gpu_solver
        decided.update(solver(problem))
    get = decided.get  # id -> new allocation, or None: dropped; not decided: keep as it is
    return [new for new in (get(a.action_id, a) for a in cands) if new is not None]


def cpu_free_ids(problem: PoolProblem) -> list[int]:
    node = problem.state.cpu[problem.key[1]]
    return node.free_in_group(problem.key[2])


def cpu_decision(
    problem: PoolProblem, keep: int, units: Sequence[int], ids: Sequence[int] | None = None
) -> Decision:
    """Allocations for the first `keep` members with `units` cores each (0: wait); rest dropped.

    `ids`: the pool's free core ids, ascending (`cpu_free_ids`), if the caller has them.
    """
    free = tuple(cpu_free_ids(problem) if ids is None else ids)
    out: Decision = {}
    pos = 0
    cpu = ResourceKind.CPU
    for i, (action, alloc) in enumerate(problem.members):
        u = units[i] if i < keep else 0
        if u == 0:
            out[action.action_id] = None
            continue
        out[action.action_id] = Allocation(
            action.action_id, cpu, alloc.pool, u, free[pos : pos + u], alloc.evict
        )
        pos += u
    return out


def dp_cpu_solver(problem: PoolProblem) -> Decision:
    """Algorithm 1's drop-tail search with the exact DP (Algorithm 3) per CPU pool."""
    free = len(cpu_free_ids(problem))
    return drop_tail(problem, lambda opts: cpu_arrange(free, opts), free)


def dp_gpu_solver(problem: PoolProblem) -> Decision:
    """Drop-tail with the buddy-chunk DP (Algorithm 4) on one GPU node."""
    node = problem.state.gpu[problem.key[1]]
    op = GpuBuddy.from_counts(node.free_chunk_counts())
    return drop_tail(problem, lambda opts: arrange(op, opts), len(node.free))


def drop_tail(
    problem: PoolProblem,
    solve: Callable[[list[list[tuple[int, float]]]], tuple[float, list[int]] | None],
    free_units: int,
    extra_s: Callable[[QueuedAction, int], float] | None = None,
    fixed: dict[str, int] | None = None,
) -> Decision:
    """Algorithm 1's loop: drop tail candidates while the estimated objective improves.

    `extra_s(action, units)` is added to an option's duration (e.g. an expected restore);
    `fixed` pins some candidates (by action id) to one unit count.
    """
    members, now_s = problem.members, problem.now_s

    def cost_s(action: QueuedAction, units: int) -> float:
        d = action.duration_s(units)
        return d + extra_s(action, units) if extra_s is not None else d

    is_gpu = problem.key[0] == "gpu"
    num_gpus = problem.capacity
    best: tuple[float, int, list[int]] | None = None
    for keep in range(len(members), 0, -1):
        kept = members[:keep]
        opts = []
        for action, _ in kept:
            if fixed is not None and action.action_id in fixed:
                allowed = [fixed[action.action_id]]
            elif is_gpu:
                allowed = gpu_unit_options(action, num_gpus)
            else:
                allowed = [u for u in action.cost.units.units if u <= free_units]
            opts.append([(u, cost_s(action, u)) for u in allowed])
        res = solve(opts)
        if res is None:
            continue
        total_s, units = res
        ends = [(now_s + cost_s(a, u), u) for (a, _), u in zip(kept, units, strict=True)]
        wait = waiting(a for a, _ in members[keep:]) + problem.rest
        obj = total_s + problem.rest_estimate_s(ends, wait)
        if best is not None and obj >= best[0]:
            break
        best = (obj, keep, units)
    if best is None:
        return {}
    _, keep, units = best
    if not is_gpu:
        return cpu_decision(problem, keep, units)
    return gpu_decision(problem, keep, units)


def gpu_decision(problem: PoolProblem, keep: int, units: Sequence[int]) -> Decision:
    """Concrete chunks for the kept members; {} (keep the minimum placement) if they clash."""
    node = problem.state.gpu[problem.key[1]]
    wanted = [(a, units[i]) for i, (a, _) in enumerate(problem.members[:keep])]
    chunks = pick_gpu_chunks(node, wanted)
    if chunks is None:
        return {}
    out: Decision = {}
    for i, (action, _) in enumerate(problem.members):
        if i >= keep:
            out[action.action_id] = None
        else:
            out[action.action_id] = Allocation(
                action.action_id, ResourceKind.GPU, node.name, units[i], chunks[i]
            )
    return out
