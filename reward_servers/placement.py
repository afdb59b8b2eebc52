"""Evict-on-execution, the deciding half: pure functions of the node's replica table.

Nothing here does I/O or reads a clock: callers pass `now_s`. `replicas.ReplicaManager` turns the
decisions into Triton load/unload calls and control-socket moves (Ray Serve style: decide, then
act).

Memory model: a replica of DoP d on chunk c takes `memory_mb` on every GPU of c (weights are
replicated per instance); a GPU's budget is the node's `gpu_memory_mb`. Which idle replicas make
room is the scheduler's one eviction rule, `scheduler.gpu_cache.lru_victims`.

The host tier (issue 38): with a host budget (`host_memory_mb` > 0), a replica that leaves the
device is *offloaded*: its process and its weights stay in host memory, and a later call on its
chunk *restores* it (a copy) instead of loading it cold. Every loaded replica is charged its host
copy and its processes (`memory_mb` + `host_process_mb` per instance) against the node's host
budget, on the device or not; a cold load that would overrun the budget first drops host-only
replicas, least recently used first, then unloads its device victims instead of offloading
them. The budget bounds what is kept in host memory: a load onto the GPUs still goes ahead when
only replicas on the GPUs are left to drop. With no host budget a victim is unloaded, as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from reward_servers.naming import aligned_chunks, replica_name, service_name
from scheduler.gpu_cache import Instance, lru_victims


class ReplicaState(StrEnum):
    LOADING = "loading"  # cold load requested; counts against memory, not evictable
    READY = "ready"  # on the device and serving (cached when in_flight == 0)
    OFFLOADING = "offloading"  # leaving the device for host memory; device memory already handed on
    HOST = "host"  # loaded, weights in host memory only: restorable on its chunk
    RESTORING = "restoring"  # weights being copied back to the device; counts against memory
    UNLOADING = "unloading"  # chosen to go entirely; its memory already handed on


# The one table of allowed lifecycle moves; `NodeReplicas.transition` enforces it.
TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    ReplicaState.LOADING: frozenset({ReplicaState.READY, ReplicaState.UNLOADING}),
    ReplicaState.READY: frozenset({ReplicaState.OFFLOADING, ReplicaState.UNLOADING}),
    ReplicaState.OFFLOADING: frozenset({ReplicaState.HOST, ReplicaState.UNLOADING}),
    ReplicaState.HOST: frozenset({ReplicaState.RESTORING, ReplicaState.UNLOADING}),
    ReplicaState.RESTORING: frozenset({ReplicaState.READY, ReplicaState.UNLOADING}),
    ReplicaState.UNLOADING: frozenset(),
}
# States that hold the replica's memory on its chunk's GPUs.
ON_DEVICE = frozenset({ReplicaState.LOADING, ReplicaState.READY, ReplicaState.RESTORING})
IN_HOST = frozenset({ReplicaState.OFFLOADING, ReplicaState.HOST})


@dataclass
class Replica:
    """A service loaded (or loading) on one chunk: on its GPUs, or kept in host memory."""

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
    """The replica table of one GPU node (`host_memory_mb` 0: no host tier; `host_process_mb`:
    what one instance's process costs in host memory besides its weights)."""

    num_gpus: int
    gpu_memory_mb: int
    replicas: dict[str, Replica] = field(default_factory=dict)
    host_memory_mb: int = 0
    host_process_mb: int = 0

    def host_mb(self, memory_mb: int, dop: int) -> int:
        """A replica's charge to the host budget: an instance per GPU of its chunk, each with
        its host copy of the weights and its process."""
        return (memory_mb + self.host_process_mb) * dop

    def used_mb(self, gpu: int) -> int:
        """Memory (MiB) held on `gpu` by replicas on the device (loading, ready, restoring)."""
        return sum(r.memory_mb for r in self.replicas.values() if gpu in r.chunk and r.state in ON_DEVICE)

    def host_used_mb(self) -> int:
        """Host memory (MiB) charged to loaded replicas, wherever their weights are."""
        return sum(
            self.host_mb(r.memory_mb, r.dop)
            for r in self.replicas.values()
            if r.state is not ReplicaState.UNLOADING
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

    def copy(self) -> NodeReplicas:
        return NodeReplicas(
            self.num_gpus,
            self.gpu_memory_mb,
            {k: _copy(r) for k, r in self.replicas.items()},
            self.host_memory_mb,
            self.host_process_mb,
        )


@dataclass(frozen=True)
class Placement:
    """Where a request goes: a replica on the device (load=False), one restored from host
    memory (restore=True), or a new one loaded cold (load=True), after `victims` leave the
    device (offloaded, unless in `drops`) and `drops` are unloaded entirely. A warm-up
    placement with `host` is loaded and then offloaded at once (it fills the host tier)."""

    replica: str
    chunk: tuple[int, ...]
    load: bool
    victims: tuple[str, ...] = ()
    restore: bool = False
    drops: tuple[str, ...] = ()
    host: bool = False


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


def host_drops(node: NodeReplicas, need_mb: int, victims: Sequence[str] = ()) -> tuple[str, ...]:
    """Replicas to unload entirely so that a new host copy of `need_mb` fits the host budget:
    host-only replicas least recently used first, then (if still short) the new load's device
    `victims`, which are then unloaded instead of offloaded. Empty with no host tier or room."""
    if node.host_memory_mb <= 0:
        return ()
    short = node.host_used_mb() + need_mb - node.host_memory_mb
    out: list[str] = []
    hosted = sorted(
        (r for r in node.replicas.values() if r.state is ReplicaState.HOST and r.in_flight == 0),
        key=lambda r: (r.last_used_s, r.name),
    )
    for r in [*hosted, *(node.replicas[v] for v in victims)]:
        if short <= 0:
            break
        out.append(r.name)
        short -= node.host_mb(r.memory_mb, r.dop)
    return tuple(out)


def plan_placement(
    node: NodeReplicas,
    model: str,
    dop: int,
    memory_mb: int,
    chunk: tuple[int, ...] | None = None,
) -> Placement | None:
    """Decide where one batch for (model, dop) runs.

    With `chunk` (the scheduler's allocation) the replica must be on it. Without, prefer a chunk
    whose replica is on the device (least in flight), then one whose replica is in host memory
    (a restore), then a cold load; among restores and loads, the fewest and least recently used
    evictions. None when nothing fits without touching in-flight replicas (or the only replica
    is still leaving the device): the caller waits.
    """
    chunks = [chunk] if chunk is not None else aligned_chunks(node.num_gpus, dop)
    if chunk is not None and (len(chunk) != dop or chunk not in aligned_chunks(node.num_gpus, dop)):
        raise ValueError(f"chunk {chunk} is not an aligned chunk of {dop} GPUs on a {node.num_gpus}-GPU node")
    existing = {r.chunk: r for r in node.of_service(model, dop)}
    resident = [existing[c] for c in chunks if c in existing and existing[c].state in ON_DEVICE]
    if resident:
        best = min(resident, key=lambda r: (r.in_flight, r.state is not ReplicaState.READY, r.chunk))
        return Placement(best.name, best.chunk, load=False)
    hosted = [existing[c] for c in chunks if c in existing and existing[c].state is ReplicaState.HOST]
    restore = _restore(node, hosted, memory_mb)
    if restore is not None:
        return restore
    if hosted or any(c in existing for c in chunks):
        return None  # its replica is in host memory or on its way there: wait, then restore
    return _load(node, model, dop, memory_mb, chunks)


def _restore(node: NodeReplicas, hosted: Sequence[Replica], memory_mb: int) -> Placement | None:
    """Restoring the host-only replica of `hosted` that needs the fewest, least recently used
    evictions; None when none fits."""
    by_chunk = {r.chunk: r for r in hosted}
    best = _cheapest(node, list(by_chunk), memory_mb)
    if best is None:
        return None
    c, victims = best
    return Placement(by_chunk[c].name, c, load=False, victims=victims, restore=True)


def _load(
    node: NodeReplicas, model: str, dop: int, memory_mb: int, chunks: Sequence[tuple[int, ...]]
) -> Placement | None:
    """A cold load of (model, dop) on the cheapest of `chunks`, with the host copies it drops;
    None when it fits on none."""
    best = _cheapest(node, chunks, memory_mb)
    if best is None:
        return None
    c, victims = best
    drops = host_drops(node, node.host_mb(memory_mb, dop), victims)
    return Placement(replica_name(model, dop, c), c, load=True, victims=victims, drops=drops)


def _cheapest(
    node: NodeReplicas, chunks: Sequence[tuple[int, ...]], memory_mb: int
) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
    """The chunk of `chunks` where `memory_mb` fits after the fewest, least recently used
    evictions, and those victims; None when it fits on none."""
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
    return c, victims


def plan_warmup(node: NodeReplicas, services: Sequence[tuple[str, int, int]]) -> tuple[Placement, ...]:
    """Where to load the configured services before any request arrives (a fresh deployment).

    `services` are (model, dop, memory_mb per GPU), in the order to warm. One replica of each
    first, then further replicas on chunks that do not hold the service yet, round robin, for
    as long as memory allows, so that the scheduler finds the service warm on whichever chunk
    is free. Each goes to the chunk with the most free memory (lowest first on a tie). Never
    evicts, and never loads a service twice on one chunk.

    With a host tier, the services that found no room on the device come first, as `host`
    placements (loaded, then offloaded at once, while the device is still empty), each on the
    chunk holding the fewest host-only replicas, while the host budget holds them: the first
    call of every service is then at worst a restore.
    """
    sim = node.copy()
    device: list[Placement] = []
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
            if not fits or (
                sim.host_memory_mb and sim.host_used_mb() + sim.host_mb(memory_mb, dop) > sim.host_memory_mb
            ):
                continue
            chunk = max(fits, key=lambda c: (free[c], -c[0]))
            name = replica_name(model, dop, chunk)
            sim.replicas[name] = Replica(name, model, dop, chunk, memory_mb, ReplicaState.READY)
            device.append(Placement(name, chunk, load=True))
            placed = True
    return (*_host_warmup(sim, services), *device)


def _host_warmup(sim: NodeReplicas, services: Sequence[tuple[str, int, int]]) -> list[Placement]:
    """Host placements: one replica of each service the GPUs have no room for, then, round
    robin over the services, more on each chunk that has none of the service yet, while the
    budget holds them (a host copy serves calls on its own chunk only)."""
    out: list[Placement] = []
    if sim.host_memory_mb <= 0:
        return out
    todo = list(services)
    firsts = [s for s in todo if not sim.of_service(s[0], s[1])]
    for model, dop, memory_mb in firsts:
        _host_one(sim, model, dop, memory_mb, out)
    placed = True
    while placed:
        placed = False
        for model, dop, memory_mb in todo:
            placed = _host_one(sim, model, dop, memory_mb, out) or placed
    return out


def _host_one(sim: NodeReplicas, model: str, dop: int, memory_mb: int, out: list[Placement]) -> bool:
    """Add one host copy of (model, dop) on the chunk without one that holds the fewest host
    copies (lowest first), if the budget and the GPUs allow; True when it did."""
    if memory_mb > sim.gpu_memory_mb or sim.host_used_mb() + sim.host_mb(memory_mb, dop) > sim.host_memory_mb:
        return False
    taken = {r.chunk for r in sim.of_service(model, dop)}
    chunks = [c for c in aligned_chunks(sim.num_gpus, dop) if c not in taken]
    if not chunks:
        return False
    hosted = [r.chunk for r in sim.replicas.values() if r.state is ReplicaState.HOST]
    chunk = min(chunks, key=lambda c: (sum(bool(set(c) & set(h)) for h in hosted), c))
    name = replica_name(model, dop, chunk)
    sim.replicas[name] = Replica(name, model, dop, chunk, memory_mb, ReplicaState.HOST)
    out.append(Placement(name, chunk, load=True, host=True))
    return True


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
    Growth restores a host-only replica of the service where there is one, else loads one;
    it never evicts a replica of a service that has demand itself, nor an in-flight one.
    Shrinking takes extras off the device (offloaded, with a host tier).
    """
    grow: list[Placement] = []
    shrink: list[str] = []
    sim = node.copy()
    hot = {(m, d) for (m, d), q in demand.items() if q > 0}
    gone = ReplicaState.OFFLOADING if sim.host_memory_mb > 0 else ReplicaState.UNLOADING
    for (model, dop), queued in sorted(demand.items(), key=lambda kv: -kv[1]):
        have = [r for r in sim.of_service(model, dop) if r.state in ON_DEVICE]
        if not have or len(have) >= policy.max_replicas_per_service:
            continue  # a service with no replica on the device is restored or loaded on execution
        if queued <= policy.scale_up_queue_per_replica * len(have):
            continue
        protected = {r.name for r in sim.replicas.values() if (r.model, r.dop) in hot}
        pick = _grow_target(sim, model, dop, memory_mb[model], protected)
        if pick is None:
            continue
        grow.append(pick)
        for v in pick.victims:
            sim.transition(v, ReplicaState.UNLOADING if v in pick.drops else gone)
        for d in pick.drops:
            if d not in pick.victims:
                sim.transition(d, ReplicaState.UNLOADING)
        if pick.restore:
            sim.transition(pick.replica, ReplicaState.RESTORING)
        else:
            sim.replicas[pick.replica] = Replica(pick.replica, model, dop, pick.chunk, memory_mb[model])
    by_service: dict[str, list[Replica]] = {}
    for r in sim.replicas.values():
        if r.state in ON_DEVICE:
            by_service.setdefault(r.service, []).append(r)
    for reps in by_service.values():
        expired = [r for r in reps if r.idle and now_s - r.last_used_s >= policy.idle_timeout_s]
        expired.sort(key=lambda r: r.last_used_s)
        keep = max(policy.min_cached_replicas, len(reps) - len(expired))
        shrink.extend(r.name for r in expired[: len(reps) - keep])
    return ScalingPlan(tuple(grow), tuple(shrink))


def _grow_target(
    node: NodeReplicas, model: str, dop: int, memory_mb: int, protected: set[str]
) -> Placement | None:
    saved = {n: node.replicas[n].in_flight for n in protected}
    for n in protected:  # treat replicas of hot services as busy so they are never victims
        node.replicas[n].in_flight += 1
    try:
        mine = {r.chunk: r for r in node.of_service(model, dop)}
        restore = _restore(node, [r for r in mine.values() if r.state is ReplicaState.HOST], memory_mb)
        if restore is not None:
            return restore
        return _load(
            node, model, dop, memory_mb, [c for c in aligned_chunks(node.num_gpus, dop) if c not in mine]
        )
    finally:
        for n, v in saved.items():
            node.replicas[n].in_flight = v


def _copy(r: Replica) -> Replica:
    return Replica(r.name, r.model, r.dop, r.chunk, r.memory_mb, r.state, r.in_flight, r.last_used_s)
