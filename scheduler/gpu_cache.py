"""GPU "evict on execution": which services are resident on which buddy chunks, LRU eviction.

Every (service, chunk) pair is its own service instance (each DoP configuration is a separate
deployment, as in the paper). A call given a chunk finds its instance in one of three tiers
(`Tier`): resident on the chunk's GPUs (no restore); host-resident, its process and weights
kept in host memory after an eviction (a restore copies the weights back); or nowhere (a cold
load). Making it resident first evicts idle instances until its per-GPU footprint fits; an
evicted instance stays host-resident while the node's host budget (`host_memory_mb`) holds
it, the least recently used host-only instances going first when it does not. With no budget
(None) every service counts as backed up in host memory on every chunk from the start (the
paper's assumption): a miss is always a host restore.

The eviction rule is `lru_victims`, the one model of it: the least recently used idle instance
that holds memory on a GPU still short goes first, and an instance that would free nothing
where memory is short is never taken. Two callers apply it to their own memory figures:
`GpuCache` below (the scheduler's view of a node: the simulator's GPU nodes, and the live
scheduler's predicted residency), and the live GPU worker's replica table
(`reward_servers.placement.victims_for`, which carries the evictions out on Triton).
`GpuCache.resident` has the shape of `GpuNode.resident`: `dict[chunk, list[service]]`, most
recently used last; `GpuCache.host` (the host-only instances, disjoint from `resident`) that of
`GpuNode.host_resident`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import cast

Chunk = tuple[int, ...]
FootprintFn = Callable[[str, int], int]  # (service, units) -> MB needed on each GPU


class Tier(StrEnum):
    """Where a service instance's weights were when a call needed it on its chunk (issue 38):
    the restore a call paid is that tier's. The live GPU worker reports it per call; the
    scheduler learns a restore cost per (service, tier); the simulator charges the same."""

    DEVICE = "device"  # resident on the chunk's GPUs: no restore
    HOST = "host"  # kept in host memory by a live process: weights copied back (ms on a GPU host)
    COLD = "cold"  # nowhere: a cold load (process start, imports, weights read from storage)


@dataclass(frozen=True, slots=True)
class Instance:
    """An idle resident instance that eviction may take: `memory_mb` on each GPU of `chunk`,
    last used at `used_s`; `key` names it to the caller."""

    key: Hashable
    chunk: Chunk
    memory_mb: int
    used_s: float


def lru_victims(
    idle: Iterable[Instance], chunk: Chunk, need_mb: int, free_mb: Mapping[int, int], gpu_memory_mb: int
) -> list[Hashable] | None:
    """Keys of the instances to evict so that `need_mb` fits on every GPU of `chunk`.

    `idle`: the instances that may go, in the caller's tie-break order (the sort by last use is
    stable); `free_mb`: free MiB per GPU of `chunk` now. Least recently used first; an instance
    is taken only if it holds memory on a GPU of `chunk` that is still short. None when even
    all of them would not make room (or `need_mb` exceeds a GPU).
    """
    if need_mb > gpu_memory_mb:
        return None
    free = {g: free_mb[g] for g in chunk}
    out: list[Hashable] = []
    for inst in sorted(idle, key=lambda i: i.used_s):
        short = [g for g in chunk if free[g] < need_mb]
        if not short:
            break
        if not any(g in inst.chunk for g in short):
            continue
        out.append(inst.key)
        for g in inst.chunk:
            if g in free:
                free[g] += inst.memory_mb
    if any(free[g] < need_mb for g in chunk):
        return None
    return out


@dataclass(frozen=True, slots=True)
class GpuLoad:
    """What running `service` on `chunk` of GPU node `pool` does to the node's residency: a hit,
    or a restore after evicting `victims` ((chunk, service) pairs). `tier`: where the weights
    come from (DEVICE for a hit; a miss planned without a cache, as a warm placement, says HOST
    and its executor charges what `GpuCache.apply` finds)."""

    pool: str
    chunk: Chunk
    service: str
    hit: bool
    victims: tuple[tuple[Chunk, str], ...] = ()
    tier: Tier = Tier.HOST

    def __post_init__(self) -> None:
        if self.hit != (self.tier is Tier.DEVICE):
            if self.hit:
                object.__setattr__(self, "tier", Tier.DEVICE)
            else:
                raise ValueError(f"a miss cannot come from the {self.tier.value} tier")


@dataclass
class GpuCache:
    """Resident service instances of one GPU node. `gpu_memory_mb` is per GPU.

    `host_memory_mb`: the node's host-memory budget for instances (MiB for the whole node;
    None: unlimited, every service backed up on every chunk). Every instance, device-resident
    or host-only, holds `host_footprint_mb(service, units)` of it (None: the per-GPU footprint
    times the units). `host`: the host-only instances (evicted, process kept), chunk ->
    services, least recently used first.
    """

    gpu_memory_mb: int
    footprint_mb: FootprintFn
    resident: dict[Chunk, list[str]] = field(default_factory=dict)
    _used_at_s: dict[tuple[Chunk, str], float] = field(default_factory=dict)
    host_memory_mb: int | None = None
    host_footprint_mb: FootprintFn | None = None
    host: dict[Chunk, list[str]] = field(default_factory=dict)

    def is_resident(self, chunk: Chunk, service: str) -> bool:
        return service in self.resident.get(chunk, ())

    def tier_of(self, chunk: Chunk, service: str) -> Tier:
        """Where `service`'s weights are for a call on `chunk` now."""
        if self.is_resident(chunk, service):
            return Tier.DEVICE
        if self.host_memory_mb is None or service in self.host.get(chunk, ()):
            return Tier.HOST
        return Tier.COLD

    def used_mb(self, gpu: int) -> int:
        """Memory held on one GPU by resident instances."""
        return sum(
            self.footprint_mb(s, len(chunk))
            for chunk, services in self.resident.items()
            if gpu in chunk
            for s in services
        )

    def victims(self, chunk: Chunk, service: str) -> list[tuple[Chunk, str]] | None:
        """Instances to evict so that `service` fits on `chunk` (`lru_victims`); None if it never can.

        Only instances overlapping `chunk` are candidates: they are idle, because the chunk is
        held exclusively by the action about to run. Ties in last use go by (chunk, service).
        """
        pairs = sorted(
            (c, s) for c, services in self.resident.items() if set(c) & set(chunk) for s in services
        )
        idle = [
            Instance(p, p[0], self.footprint_mb(p[1], len(p[0])), self._used_at_s.get(p, 0.0)) for p in pairs
        ]
        free = {g: self.gpu_memory_mb - self.used_mb(g) for g in chunk}
        keys = lru_victims(idle, chunk, self.footprint_mb(service, len(chunk)), free, self.gpu_memory_mb)
        return None if keys is None else cast(list[tuple[Chunk, str]], keys)

    def plan(self, pool: str, chunk: Chunk, service: str) -> GpuLoad:
        """What making `service` resident on `chunk` takes (nothing changes); ValueError if it
        never fits."""
        if self.is_resident(chunk, service):
            return GpuLoad(pool, chunk, service, True)
        evicted = self.victims(chunk, service)
        if evicted is None:
            raise ValueError(f"service {service} does not fit on chunk {chunk}")
        return GpuLoad(pool, chunk, service, False, tuple(evicted), self.tier_of(chunk, service))

    def apply(self, load: GpuLoad, now_s: float) -> Tier:
        """Carry out a planned load: its victims go to the host tier (as far as its budget
        holds them), its service is resident and just used. Returns the tier it came from."""
        tier = Tier.DEVICE if load.hit else self.tier_of(load.chunk, load.service)
        if not load.hit:
            for c, s in load.victims:
                _take(self.resident, c, s)
                _add(self.host, c, s)
            if tier is not Tier.DEVICE:
                _take(self.host, load.chunk, load.service)
                self.resident.setdefault(load.chunk, []).append(load.service)
        self.touch(load.chunk, load.service, now_s)
        if not load.hit:
            self._trim_host()
        return tier

    def ensure(self, chunk: Chunk, service: str, now_s: float) -> tuple[bool, list[tuple[Chunk, str]]]:
        """Make `service` resident on `chunk`: (was it a hit, instances evicted)."""
        load = self.plan("", chunk, service)
        self.apply(load, now_s)
        return load.hit, list(load.victims)

    def copy(self) -> GpuCache:
        """An independent copy (for planning a round's loads without changing this one)."""
        return GpuCache(
            self.gpu_memory_mb,
            self.footprint_mb,
            {c: list(v) for c, v in self.resident.items()},
            dict(self._used_at_s),
            self.host_memory_mb,
            self.host_footprint_mb,
            {c: list(v) for c, v in self.host.items()},
        )

    def learn(
        self,
        resident: Mapping[Chunk, Iterable[str]],
        now_s: float,
        host: Mapping[Chunk, Iterable[str]] | None = None,
    ) -> None:
        """Replace the resident map (and the host-only one, when given) with what the node
        reports, in place (`GpuNode.resident` and `host_resident` may be these very dicts).
        Instances still there keep their last use; new ones count as used at `now_s`, in the
        reported order (most recently used last)."""
        fresh = _fresh(resident)
        kept = _fresh(host) if host is not None else self.host
        kept = {c: [s for s in v if s not in fresh.get(c, ())] for c, v in kept.items()}
        kept = {c: v for c, v in kept.items() if v}
        used = {
            k: v
            for k, v in self._used_at_s.items()
            if k[1] in fresh.get(k[0], ()) or k[1] in kept.get(k[0], ())
        }
        for c, services in (*kept.items(), *fresh.items()):
            for s in services:
                used.setdefault((c, s), now_s)
        self.resident.clear()
        self.resident.update(fresh)
        self.host.clear()
        self.host.update(kept)
        self._used_at_s = used

    def touch(self, chunk: Chunk, service: str, now_s: float) -> None:
        """Mark an instance as just used (LRU order)."""
        self._used_at_s[(chunk, service)] = now_s
        services = self.resident.get(chunk)
        if services and services[-1] != service and service in services:
            services.remove(service)
            services.append(service)

    def expire(self, idle_before_s: float) -> int:
        """Unload every instance last used before `idle_before_s` (a keep-alive window ran out);
        returns how many. An instance in use is marked with an infinite time by its user."""
        gone = [
            (c, s)
            for c, services in self.resident.items()
            for s in services
            if self._used_at_s.get((c, s), 0.0) < idle_before_s
        ]
        for c, s in gone:
            self.resident[c].remove(s)
            if not self.resident[c]:
                del self.resident[c]
            self._used_at_s.pop((c, s), None)
        return len(gone)

    def unload(self, chunk: Chunk, service: str) -> bool:
        """Take one resident instance off the device (a warm placement retired): it stays
        host-resident as an evicted one does; False if it was not there."""
        if not _take(self.resident, chunk, service):
            return False
        _add(self.host, chunk, service)
        self._trim_host()
        return True

    def warm_host(self, chunk: Chunk, service: str) -> bool:
        """Put `service` in host memory on `chunk` at start-up (the live worker's warm-up fills
        the host tier first: loaded, then offloaded), if the host budget holds it without
        dropping anything; True when it was added."""
        if self.tier_of(chunk, service) is Tier.DEVICE or service in self.host.get(chunk, ()):
            return False
        budget_mb = self.host_memory_mb
        if budget_mb is not None and self.host_used_mb() + self._host_mb(service, chunk) > budget_mb:
            return False
        _add(self.host, chunk, service)
        return True

    def host_used_mb(self) -> int:
        """Host memory held by the node's instances, device-resident and host-only."""
        return sum(self._host_mb(s, c) for m in (self.resident, self.host) for c, ss in m.items() for s in ss)

    def _host_mb(self, service: str, chunk: Chunk) -> int:
        """Host memory of one instance (`host_footprint_mb`, else per-GPU footprint x GPUs)."""
        if self.host_footprint_mb is not None:
            return self.host_footprint_mb(service, len(chunk))
        return self.footprint_mb(service, len(chunk)) * len(chunk)

    def _trim_host(self) -> None:
        """Over the host budget: drop host-only instances, least recently used first, until it
        holds the rest (or none is left: device-resident instances are never dropped)."""
        if self.host_memory_mb is None or not self.host:
            return
        over = self.host_used_mb() - self.host_memory_mb
        order = sorted((self._used_at_s.get((c, s), 0.0), c, s) for c, ss in self.host.items() for s in ss)
        for _, c, s in order:
            if over <= 0:
                break
            _take(self.host, c, s)
            self._used_at_s.pop((c, s), None)
            over -= self._host_mb(s, c)

    def preload(self, chunk: Chunk, service: str) -> None:
        """Make `service` resident on `chunk` at start-up (no eviction, no cost)."""
        if not self.is_resident(chunk, service):
            self.resident.setdefault(chunk, []).append(service)


def _take(where: dict[Chunk, list[str]], chunk: Chunk, service: str) -> bool:
    """Remove `service` from `where[chunk]` (the chunk too when it empties); False if absent."""
    services = where.get(chunk)
    if not services or service not in services:
        return False
    services.remove(service)
    if not services:
        del where[chunk]
    return True


def _add(where: dict[Chunk, list[str]], chunk: Chunk, service: str) -> None:
    """Add `service` to `where[chunk]` as its most recently used, unless it is there."""
    services = where.setdefault(chunk, [])
    if service not in services:
        services.append(service)


def _fresh(m: Mapping[Chunk, Iterable[str]]) -> dict[Chunk, list[str]]:
    return {tuple(c): [str(s) for s in services] for c, services in m.items() if services}
