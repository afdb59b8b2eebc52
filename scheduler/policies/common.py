"""Pieces shared by the elastic policies: pools, the completion-heap estimate, GPU chunk picks.

A *pool* is the unit of elastic allocation: one NUMA group of one CPU node
(`("cpu", node, group)`), or one GPU node (`("gpu", node, 0)`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any

from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.queue import WaitingQueue, merge_fcfs
from scheduler.resources import GPU_CHUNK_SIZES, ClusterState, GpuNode

PoolKey = tuple[str, str, int]
Busy = tuple[float, int]  # (expected end in s, units)
Waiting = tuple[int, float, QueuedAction]  # (min units, duration at min units in s, action)


def waiting(actions: Iterable[QueuedAction], memo: dict[str, Any] | None = None) -> list[Waiting]:
    """Precompute what the completion-heap estimate needs per waiting action.

    `memo` (a `WaitingQueue.memo`) keeps each action's entry across rounds; an entry is reused
    only while the action's cost, T1 and efficiency curve are the very objects it was made
    from, so re-estimating a waiting action is always seen.
    """
    out: list[Waiting] = []
    append = out.append
    if memo is None:
        for a in actions:
            units = a.cost.units.units[0]
            append((units, a.duration_s(units), a))
        return out
    get = memo.get
    for a in actions:
        m = get(a.action_id)
        if m is not None and m[0] is a.cost and m[1] is a.t1_s and m[2] is a.efficiency and m[3][2] is a:
            append(m[3])
            continue
        units = a.cost.units.units[0]
        w = (units, a.duration_s(units), a)
        memo[a.action_id] = (a.cost, a.t1_s, a.efficiency, w)
        append(w)
    return out


def pool_of(alloc: Allocation, state: ClusterState) -> PoolKey:
    """The pool an allocation draws from."""
    kind, pool, group = state.pool_key(alloc)
    return (str(kind), pool, group)


def busy_by_pool(
    state: ClusterState, now_s: float, pools: Iterable[PoolKey] | None = None
) -> dict[PoolKey, list[Busy]]:
    """Running allocations per pool (of `pools`, or all) as (expected end, units), in start order.

    Unknown ends count as `now_s`. Pools without a running allocation are left out. Riders and
    time sharers hold no units of their own, but a core whose holder ended while sharers run
    on it comes back when the last of them ends (`ClusterState.share_cores`).
    """
    if pools is None:
        pools = {pool_of(a, state) for a in state.running.values() if a.kind is not ResourceKind.API}
    out: dict[PoolKey, list[Busy]] = {}
    ends = state.expected_end_s
    shared = state.shared
    kinds = {"cpu": ResourceKind.CPU, "gpu": ResourceKind.GPU}
    for key in pools:
        bucket = []
        vacated = state.cpu[key[1]].vacated if key[0] == "cpu" else None
        back: dict[int, float] = {}  # vacated core -> when its last sharer ends
        for aid, alloc in state.running_in(kinds[key[0]], key[1], key[2]).items():
            if not alloc.unit_ids:
                continue
            end_s = ends.get(aid, now_s)
            end_s = end_s if end_s > now_s else now_s
            if aid in shared:
                if vacated and alloc.shares:
                    for c in vacated.intersection(alloc.unit_ids):
                        back[c] = max(back.get(c, now_s), end_s)
                continue
            bucket.append((end_s, alloc.units))
        bucket += [(end_s, 1) for end_s in back.values()]
        if bucket:
            out[key] = bucket
    return out


def pool_capacity(key: PoolKey, state: ClusterState) -> int:
    """Total units of a pool (busy or not)."""
    if key[0] == "cpu":
        return len(state.cpu[key[1]].numa[key[2]])
    return state.gpu[key[1]].num_gpus


def distribute_rest(
    queue: Sequence[QueuedAction],
    state: ClusterState,
    pools: Sequence[PoolKey],
    skip: Collection[str] = (),
) -> dict[PoolKey, list[QueuedAction]]:
    """Assign the queued actions not in `skip` (this round's candidates) to the pools they will
    probably use, for the estimate; each pool's list in FCFS order.

    CPU actions of a pinned trajectory go to its node's pools; others, and GPU actions of a
    service, are spread round-robin over the candidate pools of their kind. API actions are
    left out (they do not compete for elastic units). Over a `WaitingQueue` only the actions
    routed to the pools' nodes are looked at; the result is the same as over a list.
    """
    if isinstance(queue, WaitingQueue):
        return _distribute_indexed(queue, state, pools, skip)
    out: dict[PoolKey, list[QueuedAction]] = {p: [] for p in pools}

    def round_robin(choices: list[PoolKey]) -> Iterator[Callable[[QueuedAction], None]] | None:
        return itertools.cycle([out[p].append for p in choices]) if choices else None

    by_node = _cpu_pools_by_node(pools)
    any_cpu = round_robin([p for p in pools if p[0] == "cpu"])
    any_gpu = round_robin([p for p in pools if p[0] == "gpu"])
    on_node = {n: round_robin(ps) for n, ps in by_node.items()}
    pins = state.trajectory_node
    cpu, gpu = ResourceKind.CPU, ResourceKind.GPU
    for action in queue:
        if action.action_id in skip:
            continue
        kind = action.cost.key
        if kind is cpu:
            pinned = pins.get(action.trajectory_id)
            to = any_cpu if pinned is None else on_node.get(pinned)
        elif kind is gpu:
            to = any_gpu
        else:
            continue
        if to is not None:
            next(to)(action)
    return out


def _cpu_pools_by_node(pools: Sequence[PoolKey]) -> dict[str, list[PoolKey]]:
    by_node: dict[str, list[PoolKey]] = {}
    for p in pools:
        if p[0] == "cpu":
            by_node.setdefault(p[1], []).append(p)
    return by_node


def _distribute_indexed(
    queue: WaitingQueue, state: ClusterState, pools: Sequence[PoolKey], skip: Collection[str]
) -> dict[PoolKey, list[QueuedAction]]:
    """`distribute_rest` through the queue's index: each round-robin of the walk over the whole
    queue (per node, unpinned CPU, GPU) advances only on its own actions, so it is the same as
    dealing each group's FCFS list out in turn, then merging a pool's shares FCFS."""
    out: dict[PoolKey, list[QueuedAction]] = {p: [] for p in pools}
    routes = queue.routes(state)

    def deal(actions: Iterable[QueuedAction], to: list[PoolKey]) -> None:
        left = [a for a in actions if a.action_id not in skip] if skip else list(actions)
        k = len(to)
        for i, p in enumerate(to):
            share = left if k == 1 else left[i::k]
            out[p] = merge_fcfs(queue, out[p], share) if out[p] else share

    for node, ps in _cpu_pools_by_node(pools).items():
        deal(routes.on_node.get(node, {}).values(), ps)
    cpu_pools = [p for p in pools if p[0] == "cpu"]
    if cpu_pools and routes.unpinned:
        deal(routes.unpinned.values(), cpu_pools)
    gpu_pools = [p for p in pools if p[0] == "gpu"]
    if gpu_pools and routes.gpu:
        deal(routes.gpu.values(), gpu_pools)
    return out


def rest_estimate_s(
    now_s: float,
    capacity: int,
    busy: Sequence[Busy],
    rest: Sequence[Waiting],
    depth: int,
    base_heap: list[float] | None = None,
) -> float:
    """Sum over `rest` of (start - now + duration), simulated FCFS on a completion heap.

    Algorithm 2's estimate: every still-queued action takes its minimum units as soon as enough
    units are back; the first one may try its first `depth` unit counts and keeps the one that
    finishes earliest. `busy` holds the running and just-started allocations of the pool.

    The heap holds one end time per busy *unit* (an allocation of u units is u entries), as
    plain floats: an action needing u units starts at the u-th earliest time a unit is back,
    which is what popping whole allocations gives too, and float comparisons are several
    times cheaper than tuple ones in this, the hottest loop of a round. `base_heap`, if given,
    is `unit_heap` of further busy allocations (the pool's running ones, shared by every call
    of a round), to which `busy` is added.
    """
    heap = _busy_heap(busy, base_heap)
    free = capacity - len(heap)
    t_s = now_s
    total_s = 0.0
    todo: Iterable[Waiting] = rest
    push, replace = heapq.heappush, heapq.heapreplace
    if rest and depth > 1 and len(rest[0][2].cost.units.units) > 1:
        todo = itertools.islice(rest, 1, None)
        units, _, action = rest[0]
        best: tuple[float, int, list[float], int, float] | None = None
        if units <= capacity:
            for units in [u for u in action.cost.units.units if u <= capacity][:depth]:
                h = list(heap)
                got_free, got_s = _wait_for(h, free, t_s, units)
                end_s = got_s + action.duration_s(units)
                if best is None or end_s < best[0]:
                    best = (end_s, units, h, got_free, got_s)
        if best is not None:
            end_s, units, heap, free, t_s = best
            for _ in range(units):
                push(heap, end_s)
            free -= units
            total_s += end_s - now_s
    for units, dur_s, _ in todo:
        if units == 1 and not free and heap:  # common: the next unit back is this one's
            top_s = heap[0]
            if top_s > t_s:
                t_s = top_s
            end_s = t_s + dur_s
            replace(heap, end_s)
            total_s += end_s - now_s
            continue
        if units > capacity:
            continue  # never fits this pool
        if free < units:
            free, t_s = _wait_for(heap, free, t_s, units)
        end_s = t_s + dur_s
        free -= units
        for _ in range(units):
            push(heap, end_s)
        total_s += end_s - now_s
    return total_s


def _busy_heap(busy: Sequence[Busy], base_heap: list[float] | None) -> list[float]:
    """`unit_heap` of `busy`, on top of `base_heap` when given (a copy)."""
    if base_heap is None:
        return unit_heap(busy)
    if 4 * len(busy) < len(base_heap):  # a few more on a big heap: push them
        heap = list(base_heap)
        for e, u in busy:
            for _ in range(u):
                heapq.heappush(heap, e)
        return heap
    return unit_heap(busy, base_heap)


def unit_heap(busy: Sequence[Busy], more: Sequence[float] = ()) -> list[float]:
    """A heap of one end time per busy unit (see `rest_estimate_s`), plus the unit ends `more`."""
    heap = [e for e, u in busy if u == 1]
    if len(heap) < len(busy):
        for e, u in busy:
            if u != 1:
                heap += [e] * u
    heap += more
    heapq.heapify(heap)
    return heap


def _wait_for(heap: list[float], free: int, t_s: float, units: int) -> tuple[int, float]:
    """Pop unit completions until `units` are free (`units` <= capacity): (free, time)."""
    while free < units:
        t_s = max(t_s, heapq.heappop(heap))
        free += 1
    return free, t_s


def pick_gpu_chunks(
    node: GpuNode, wanted: Sequence[tuple[QueuedAction, int]]
) -> list[tuple[int, ...]] | None:
    """Concrete aligned chunks for (action, units) pairs on `node`, or None if they do not fit.

    Largest first; a chunk where the action's service is resident wins, then one where it is
    kept in host memory (a node with a host tier), otherwise the chunk in the fullest buddy
    block (best fit keeps big chunks whole).
    """
    free = set(node.free)
    order = sorted(range(len(wanted)), key=lambda i: -wanted[i][1])
    out: list[tuple[int, ...]] = [() for _ in wanted]
    for i in order:
        action, units = wanted[i]
        chunks = []
        for start in range(0, node.num_gpus - units + 1, units):
            chunk = tuple(range(start, start + units))
            if free.issuperset(chunk):
                chunks.append(chunk)
        if not chunks:
            return None

        def score(chunk: tuple[int, ...], service: str = action.target) -> tuple[int, int, int]:
            resident = service in node.resident.get(chunk, ())
            host = node.host_tier and service in node.host_resident.get(chunk, ())  # issue 38
            block = min(8, node.num_gpus)
            base = chunk[0] - chunk[0] % block
            block_free = sum(1 for g in range(base, base + block) if g in free)
            return (0 if resident else 1 if host else 2, block_free, chunk[0])

        best = min(chunks, key=score)
        free.difference_update(best)
        out[i] = best
    return out


def gpu_unit_options(action: QueuedAction, num_gpus: int) -> list[int]:
    """The buddy chunk sizes an action accepts on a node with `num_gpus` GPUs."""
    return [u for u in action.cost.units.units if u in GPU_CHUNK_SIZES and u <= num_gpus]
