"""`gpu_candidates` with restore tiers (issue 38) decides exactly as the plain version it
replaced (82f1296, with its host placements left to the FCFS placement since): a node x size x
chunk walk per action. The fast one works out per pass what
a pass keeps (resident, host and cold chunks, busy chunks' ends); over random clusters, queues
and learned costs both place the same calls on the same chunks."""

from __future__ import annotations

import random
from collections.abc import Sequence

from scheduler.duration import Amdahl
from scheduler.gpu_cache import Tier
from scheduler.model import Allocation, CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.policies.fcfs_min import fcfs_prefix
from scheduler.policies.gpu_aware import WAIT, Tiers, gpu_candidates
from scheduler.pools import GPU_CHUNK_SIZES, GpuNode
from scheduler.resources import ClusterState
from scheduler.restore_cost import RestoreCosts

SERVICES = ("rm", "judge", "teacher0", "teacher1")
Choice = tuple[float, str, tuple[int, ...]]


def _reference(
    actions: Sequence[QueuedAction], state: ClusterState, now_s: float, seen: set[str]
) -> list[Allocation]:
    """`gpu_candidates` and `Tiers` as of 82f1296, written as plainly as then; `seen` collects
    the kinds of tier choice made (to show the cases are covered)."""
    free = {n: set(g.free) for n, g in state.gpu.items()}
    tiered = any(g.host_tier for g in state.gpu.values())
    queued_s: dict[tuple[str, tuple[int, ...]], float] = {}
    out: list[Allocation] = []
    rest: list[QueuedAction] = []
    for action in actions:
        if not any(free.values()):
            break
        best: Choice | None = None
        for name, node in state.gpu.items():
            for units in action.cost.units.units:
                chunk = next(
                    (
                        c
                        for c, s in node.resident.items()
                        if len(c) == units and action.target in s and free[name].issuperset(c)
                    ),
                    None,
                )
                if chunk is not None and (best is None or action.duration_s(units) < best[0]):
                    best = (action.duration_s(units), name, chunk)
        if best is None and tiered:
            choice = _choose(action, state, now_s, free, queued_s)
            seen.add("host" if isinstance(choice, tuple) else str(choice))
            if choice == WAIT:
                continue
        if best is None:
            rest.append(action)
            continue
        _, name, chunk = best
        free[name].difference_update(chunk)
        out.append(Allocation(action.action_id, ResourceKind.GPU, name, len(chunk), chunk))
    if rest and any(free.values()):
        work = state.copy()
        for name, f in free.items():
            work.gpu[name].free = f
        out.extend(fcfs_prefix(rest, work, now_s)[0])
    order = {a.action_id: i for i, a in enumerate(actions)}
    return sorted(out, key=lambda a: order[a.action_id])


def _choose(
    action: QueuedAction,
    state: ClusterState,
    now_s: float,
    free: dict[str, set[int]],
    queued_s: dict[tuple[str, tuple[int, ...]], float],
) -> Choice | str | None:
    service, sizes = action.target, [u for u in action.cost.units.units if u in GPU_CHUNK_SIZES]
    if not sizes:
        return None
    host: Choice | None = None
    cold_s: float | None = None
    for name, node in state.gpu.items():
        for units in sizes:
            for start in range(0, node.num_gpus - units + 1, units):
                chunk = tuple(range(start, start + units))
                if not free[name].issuperset(chunk):
                    continue
                tier = node.tier(chunk, service)
                cost_s = node.restore_s(chunk, service) + action.duration_s(units)
                if tier is Tier.HOST and (host is None or cost_s < host[0]):
                    host = (cost_s, name, chunk)
                elif tier is Tier.COLD and units == min(sizes) and (cold_s is None or cost_s < cold_s):
                    cold_s = cost_s
    now_best = min((c for c in (host[0] if host else None, cold_s) if c is not None), default=None)
    if now_best is None:
        return None
    wait: tuple[float, tuple[str, tuple[int, ...]]] | None = None
    for name, node in state.gpu.items():
        if f"gpu:{name}" in state.offline:
            continue
        for chunk, services in node.resident.items():
            if service not in services or len(chunk) not in action.cost.units.units:
                continue
            ends = [
                state.expected_end_s.get(aid, now_s)
                for aid, a in state.running_in(ResourceKind.GPU, name).items()
                if set(a.unit_ids) & set(chunk)
            ]
            if not ends or min(ends) <= now_s:
                continue
            done_s = max(ends) + queued_s.get((name, chunk), 0.0) - now_s + action.duration_s(len(chunk))
            if done_s < now_best and (wait is None or done_s < wait[0]):
                wait = (done_s, (name, chunk))
    if wait is not None:
        key = wait[1]
        queued_s[key] = queued_s.get(key, 0.0) + action.duration_s(len(key[1]))
        return WAIT
    return host if host is not None and host[0] <= now_best else None


def _chunks(rng: random.Random, num_gpus: int, count: int) -> list[tuple[int, ...]]:
    out = []
    for _ in range(count):
        size = rng.choice([s for s in GPU_CHUNK_SIZES if s <= num_gpus])
        start = rng.randrange(0, num_gpus // size) * size
        out.append(tuple(range(start, start + size)))
    return out


def _call(aid: str, rng: random.Random) -> QueuedAction:
    units = rng.choice([(1,), (1, 2), (1, 2, 4, 8), (2, 4), (4, 8), (1, 2, 4)])
    cost = CostVector(ResourceKind.GPU, Elastic(units), gpu_memory_mb=100)
    service = rng.choice(SERVICES)
    t1_s = rng.choice([0.1, 0.5, 1.0, rng.uniform(0.05, 3.0)])
    curve = Amdahl(rng.choice([0.0, 0.7, 0.95, 1.0]))
    return QueuedAction(
        aid, f"t-{aid}", cost, 0.0, t1_s=t1_s, efficiency=curve, kind=f"reward:{service}", target=service
    )


def _cluster(rng: random.Random) -> tuple[ClusterState, float]:
    """A random cluster with a host tier on some node: residency, host copies, calls running
    (some past their expected end, some with none), learned costs, maybe a node offline."""
    costs = RestoreCosts(alpha=1.0)
    for _ in range(rng.randrange(4)):
        costs.observe(rng.choice(SERVICES), rng.choice(list(Tier)), rng.choice([0.02, 0.3, 1.0, 6.0]))
    nodes = {}
    for n in range(rng.randint(1, 3)):
        node = GpuNode(
            f"g{n}", rng.choice([4, 8]), 1024, restore_costs=costs, host_tier=n == 0 or rng.random() < 0.6
        )
        for chunk in _chunks(rng, node.num_gpus, rng.randrange(8)):
            node.resident[chunk] = rng.sample(SERVICES, rng.randint(1, 2))
        for chunk in _chunks(rng, node.num_gpus, rng.randrange(6)):
            node.host_resident[chunk] = rng.sample(SERVICES, rng.randint(1, 3))
        nodes[node.name] = node
    state = ClusterState(gpu=nodes)
    now_s = rng.choice([0.0, 1.0])
    for k, name in enumerate(nodes):
        for j, chunk in enumerate(_chunks(rng, nodes[name].num_gpus, rng.randrange(5))):
            if not nodes[name].free.issuperset(chunk):
                continue
            holder = _call(f"h{k}-{j}", rng)
            state.apply(
                Allocation(holder.action_id, ResourceKind.GPU, name, len(chunk), chunk), holder, now_s
            )
            end = rng.choice(
                [None, now_s - 0.5, now_s, now_s + rng.uniform(0.01, 4.0), now_s + 0.5, now_s + 0.5]
            )
            if end is None:
                del state.expected_end_s[holder.action_id]
            else:
                state.expected_end_s[holder.action_id] = end
    if len(nodes) > 1 and rng.random() < 0.2:
        state.set_offline({f"gpu:{rng.choice(list(nodes))}"})
    return state, now_s


def test_fast_tier_placement_matches_the_plain_walk() -> None:
    """Given 600 random clusters with a host tier and queues of up to 40 calls, `gpu_candidates`
    places the same calls on the same chunks as the 82f1296 walk, and the cases include host
    restores, cold loads and waiting for a busy resident chunk."""
    seen: set[str] = set()
    for seed in range(600):
        rng = random.Random(seed)
        state, now_s = _cluster(rng)
        queue = [_call(f"a{i}", rng) for i in range(rng.randint(1, 40))]
        assert gpu_candidates(queue, state, now_s) == _reference(queue, state, now_s, seen), seed
    assert {"host", "None", WAIT} <= seen


def test_a_tie_between_busy_chunks_goes_to_the_first_in_residency_order() -> None:
    """Given rm resident and busy on GPU 0 (until 1 s), GPUs 2-3 and GPU 1 (both until 0.5 s),
    a call that runs as fast on one GPU as on two waits for GPUs 2-3, the first of the equally
    soon chunks in residency order, as the plain walk does."""
    node = GpuNode("g0", 8, 1024, restore_costs=RestoreCosts(), host_tier=True)
    state = ClusterState(gpu={"g0": node})
    for chunk, end_s in (((0,), 1.0), ((2, 3), 0.5), ((1,), 0.5)):
        node.resident[chunk] = ["rm"]
        holder = QueuedAction(
            f"h{chunk}", "t", CostVector(ResourceKind.GPU, Elastic((len(chunk),))), 0.0, target="rm"
        )
        state.apply(Allocation(holder.action_id, ResourceKind.GPU, "g0", len(chunk), chunk), holder, 0.0)
        state.expected_end_s[holder.action_id] = end_s
    call = QueuedAction(
        "a", "t-a", CostVector(ResourceKind.GPU, Elastic((1, 2))), 0.0, efficiency=Amdahl(0.0), target="rm"
    )
    tiers = Tiers(state, 0.0)
    free = {"g0": set(node.free)}
    assert tiers.choose(call, free) == WAIT
    reference: dict[tuple[str, tuple[int, ...]], float] = {}
    assert _choose(call, state, 0.0, free, reference) == WAIT
    assert {tiers.chunk_keys[c]: s for c, s in tiers.queued_s.items()} == reference == {("g0", (2, 3)): 1.0}
