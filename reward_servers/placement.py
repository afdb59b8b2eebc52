"""Evict-on-execution, the deciding half: pure functions of the node's replica table.

Nothing here does I/O or reads a clock: callers pass `now_s`. `replicas.ReplicaManager` turns the
decisions into Triton load/unload calls (Ray Serve style: decide, then act).

Memory model: a replica of DoP d on chunk c takes `memory_mb` on every GPU of c (weights are
replicated per instance); a GPU's budget is the node's `gpu_memory_mb`. Which idle replicas make
room is the scheduler's one eviction rule, `scheduler.gpu_cache.lru_victims`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from reward_servers.naming import aligned_chunks, replica_name, service_name
from scheduler.gpu_cache import Instance, lru_victims


class ReplicaState(StrEnum):
    LOADING = "loading"  # load requested; counts against memory, not evictable
    READY = "ready"  # resident and serving (cached when in_flight == 0)
    UNLOADING = "unloading"  # chosen as a victim; memory already handed to the newcomer


# The one table of allowed lifecycle moves; `NodeReplicas.transition` enforces it.
TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    ReplicaState.LOADING: frozenset({ReplicaState.READY, ReplicaState.UNLOADING}),
    ReplicaState.READY: frozenset({ReplicaState.UNLOADING}),
    ReplicaState.UNLOADING: frozenset(),
}


@dataclass
class Replica:
    """A service resident (or loading) on one chunk."""

    name: str
    model: str
    dop: int
    chunk: tuple[int, ...]
    memory_mb: int  # per GPU of the chunk
    state: ReplicaState = ReplicaState.LOADING
    in_flight: int = 0  # requests (batches) leased and not yet released
    last_used_s: float = 0.0

    @property
    def service(self) -> str:
        return service_name(self.model, self.dop)

    @property
    def idle(self) -> bool:
        return self.state is ReplicaState.READY and self.in_flight == 0


@dataclass
class NodeReplicas:
    """The replica table of one GPU node."""

    num_gpus: int
    gpu_memory_mb: int
    replicas: dict[str, Replica] = field(default_factory=dict)

    def used_mb(self, gpu: int) -> int:
        """Memory (MiB) held on `gpu` by loading and ready replicas."""
        return sum(
            r.memory_mb
            for r in self.replicas.values()
            if gpu in r.chunk and r.state is not ReplicaState.UNLOADING
        )

    def of_service(self, model: str, dop: int) -> list[Replica]:
        svc = service_name(model, dop)
        return [
            r for r in self.replicas.values() if r.service == svc and r.state is not ReplicaState.UNLOADING
        ]

    def transition(self, name: str, new: ReplicaState) -> Replica:
        """Move `name` to `new`; ValueError on a move the lifecycle does not allow."""
        r = self.replicas[name]
        if new not in TRANSITIONS[r.state]:
            raise ValueError(f"replica {name}: {r.state} -> {new} is not allowed")
        r.state = new
        return r


@dataclass(frozen=True)
class Placement:
    """Where a request goes: an existing replica (load=False) or a new one after evicting victims."""

    replica: str
    chunk: tuple[int, ...]
    load: bool
    victims: tuple[str, ...] = ()


def victims_for(node: NodeReplicas, chunk: tuple[int, ...], memory_mb: int) -> tuple[str, ...] | None:
    """Idle replicas to evict, least recently used first, so `memory_mb` fits on every GPU of `chunk`.

    The scheduler's rule (`scheduler.gpu_cache.lru_victims`), applied to this node's replicas;
    ties in last use go by name. None when even evicting every idle replica there is not enough
    (in-flight ones are never taken).
    """
    idle = [
        Instance(r.name, r.chunk, r.memory_mb, r.last_used_s)
        for r in sorted(node.replicas.values(), key=lambda r: r.name)
        if r.idle
    ]
    free = {g: node.gpu_memory_mb - node.used_mb(g) for g in chunk}
    names = lru_victims(idle, chunk, memory_mb, free, node.gpu_memory_mb)
    return None if names is None else tuple(str(n) for n in names)


def plan_placement(
    node: NodeReplicas,
    model: str,
    dop: int,
    memory_mb: int,
    chunk: tuple[int, ...] | None = None,
) -> Placement | None:
    """Decide where one batch for (model, dop) runs.

    With `chunk` (the scheduler's allocation) the replica must be on it. Without, prefer a chunk
    that already holds the service (least in flight), then one needing the fewest and
    least-recently-used evictions. None when nothing fits without touching in-flight replicas.
    """
    chunks = [chunk] if chunk is not None else aligned_chunks(node.num_gpus, dop)
    if chunk is not None and (len(chunk) != dop or chunk not in aligned_chunks(node.num_gpus, dop)):
        raise ValueError(f"chunk {chunk} is not an aligned chunk of {dop} GPUs on a {node.num_gpus}-GPU node")
    existing = {r.chunk: r for r in node.of_service(model, dop)}
    resident = [existing[c] for c in chunks if c in existing]
    if resident:
        best = min(resident, key=lambda r: (r.in_flight, r.state is not ReplicaState.READY, r.chunk))
        return Placement(best.name, best.chunk, load=False)
    options = []
    for c in chunks:
        victims = victims_for(node, c, memory_mb)
        if victims is None:
            continue
        recency = max((node.replicas[v].last_used_s for v in victims), default=float("-inf"))
        options.append((len(victims), recency, c, victims))
    if not options:
        return None
    _, _, c, victims = min(options)
    return Placement(replica_name(model, dop, c), c, load=True, victims=victims)


def plan_warmup(node: NodeReplicas, services: Sequence[tuple[str, int, int]]) -> tuple[Placement, ...]:
    """Where to load the configured services before any request arrives (a fresh deployment).

    `services` are (model, dop, memory_mb per GPU), in the order to warm. One replica of each
    first, then further replicas on chunks that do not hold the service yet, round robin, for
    as long as memory allows, so that the scheduler finds the service warm on whichever chunk
    is free. Each goes to the chunk with the most free memory (lowest first on a tie). Never
    evicts, and never loads a service twice on one chunk.
    """
    sim = NodeReplicas(node.num_gpus, node.gpu_memory_mb, {k: _copy(r) for k, r in node.replicas.items()})
    out: list[Placement] = []
    placed = True
    while placed:
        placed = False
        for model, dop, memory_mb in services:
            taken = {r.chunk for r in sim.of_service(model, dop)}
            free = {
                c: min(sim.gpu_memory_mb - sim.used_mb(g) for g in c)
                for c in aligned_chunks(sim.num_gpus, dop)
                if c not in taken
            }
            fits = [c for c, mb in free.items() if mb >= memory_mb]
            if not fits:
                continue
            chunk = max(fits, key=lambda c: (free[c], -c[0]))
            name = replica_name(model, dop, chunk)
            sim.replicas[name] = Replica(name, model, dop, chunk, memory_mb, ReplicaState.READY)
            out.append(Placement(name, chunk, load=True))
            placed = True
    return tuple(out)


@dataclass(frozen=True)
class ScalingPolicy:
    """When a hot service grows across chunks and when extra replicas go away."""

    scale_up_queue_per_replica: int = 32  # queued requests per ready replica that trigger growth
    max_replicas_per_service: int = 8
    idle_timeout_s: float = 300.0  # an extra replica unused this long is unloaded
    min_cached_replicas: int = 1  # replicas per service kept cached however idle (until evicted)


@dataclass(frozen=True)
class ScalingPlan:
    grow: tuple[Placement, ...] = ()
    shrink: tuple[str, ...] = ()


def plan_scaling(
    node: NodeReplicas,
    demand: Mapping[tuple[str, int], int],
    memory_mb: Mapping[str, int],
    now_s: float,
    policy: ScalingPolicy = ScalingPolicy(),
) -> ScalingPlan:
    """Grow hot services by one replica each and shrink idle extras.

    `demand` maps (model, dop) to requests waiting for it; `memory_mb` maps model to its footprint.
    Growth never evicts a replica of a service that has demand itself, nor an in-flight one.
    """
    grow: list[Placement] = []
    shrink: list[str] = []
    sim = NodeReplicas(node.num_gpus, node.gpu_memory_mb, {k: _copy(r) for k, r in node.replicas.items()})
    hot = {(m, d) for (m, d), q in demand.items() if q > 0}
    for (model, dop), queued in sorted(demand.items(), key=lambda kv: -kv[1]):
        have = sim.of_service(model, dop)
        if not have or len(have) >= policy.max_replicas_per_service:
            continue  # a service with no replica is loaded on execution, not here
        if queued <= policy.scale_up_queue_per_replica * len(have):
            continue
        taken = {r.chunk for r in have}
        protected = {r.name for r in sim.replicas.values() if (r.model, r.dop) in hot}
        pick = _grow_target(sim, model, dop, memory_mb[model], taken, protected)
        if pick is not None:
            grow.append(pick)
            for v in pick.victims:
                sim.transition(v, ReplicaState.UNLOADING)
            sim.replicas[pick.replica] = Replica(pick.replica, model, dop, pick.chunk, memory_mb[model])
    by_service: dict[str, list[Replica]] = {}
    for r in sim.replicas.values():
        if r.state is not ReplicaState.UNLOADING:
            by_service.setdefault(r.service, []).append(r)
    for reps in by_service.values():
        expired = [r for r in reps if r.idle and now_s - r.last_used_s >= policy.idle_timeout_s]
        expired.sort(key=lambda r: r.last_used_s)
        keep = max(policy.min_cached_replicas, len(reps) - len(expired))
        shrink.extend(r.name for r in expired[: len(reps) - keep])
    return ScalingPlan(tuple(grow), tuple(shrink))


def _grow_target(
    node: NodeReplicas, model: str, dop: int, memory_mb: int, taken: set[tuple[int, ...]], protected: set[str]
) -> Placement | None:
    saved = {n: node.replicas[n].in_flight for n in protected}
    for n in protected:  # treat replicas of hot services as busy so they are never victims
        node.replicas[n].in_flight += 1
    try:
        options = []
        for c in aligned_chunks(node.num_gpus, dop):
            if c in taken:
                continue
            victims = victims_for(node, c, memory_mb)
            if victims is not None:
                options.append((len(victims), c, victims))
    finally:
        for n, v in saved.items():
            node.replicas[n].in_flight = v
    if not options:
        return None
    _, c, victims = min(options)
    return Placement(replica_name(model, dop, c), c, load=True, victims=victims)


def _copy(r: Replica) -> Replica:
    return Replica(r.name, r.model, r.dop, r.chunk, r.memory_mb, r.state, r.in_flight, r.last_used_s)
