"""GPU "evict on execution": which services are resident on which buddy chunks, LRU eviction.

Every (service, chunk) pair is its own service instance (each DoP configuration is a separate
deployment, as in the paper). Weights of every service are backed up in host memory, so a
service that is not resident on the chunk it is given is *restored* from host memory, after
evicting idle instances until its per-GPU footprint fits.

The eviction rule is `lru_victims`, the one model of it: the least recently used idle instance
that holds memory on a GPU still short goes first, and an instance that would free nothing
where memory is short is never taken. Two callers apply it to their own memory figures:
`GpuCache` below (the scheduler's view of a node: the simulator's GPU nodes, and the live
scheduler's predicted residency), and the live GPU worker's replica table
(`reward_servers.placement.victims_for`, which carries the evictions out on Triton).
`GpuCache.resident` has the shape of `GpuNode.resident`: `dict[chunk, list[service]]`, most
recently used last.
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
    or a restore after evicting `victims` ((chunk, service) pairs)."""

    pool: str
    chunk: Chunk
    service: str
    hit: bool
    victims: tuple[tuple[Chunk, str], ...] = ()


@dataclass
class GpuCache:
    """Resident service instances of one GPU node. `gpu_memory_mb` is per GPU."""

    gpu_memory_mb: int
    footprint_mb: FootprintFn
    resident: dict[Chunk, list[str]] = field(default_factory=dict)
    _used_at_s: dict[tuple[Chunk, str], float] = field(default_factory=dict)

    def is_resident(self, chunk: Chunk, service: str) -> bool:
        return service in self.resident.get(chunk, ())

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
        return GpuLoad(pool, chunk, service, False, tuple(evicted))

    def apply(self, load: GpuLoad, now_s: float) -> None:
        """Carry out a planned load: its victims go, its service is resident and just used."""
        if not load.hit:
            for c, s in load.victims:
                self.resident[c].remove(s)
                if not self.resident[c]:
                    del self.resident[c]
                self._used_at_s.pop((c, s), None)
            if not self.is_resident(load.chunk, load.service):
                self.resident.setdefault(load.chunk, []).append(load.service)
        self.touch(load.chunk, load.service, now_s)

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
        )

    def learn(self, resident: Mapping[Chunk, Iterable[str]], now_s: float) -> None:
        """Replace the resident map with what the node reports (in place: `GpuNode.resident`
        may be this very dict). Instances still there keep their last use; new ones count as
        used at `now_s`, in the reported order (most recently used last)."""
        fresh = {tuple(c): [str(s) for s in services] for c, services in resident.items() if services}
        used = {k: v for k, v in self._used_at_s.items() if k[1] in fresh.get(k[0], ())}
        for c, services in fresh.items():
            for s in services:
                used.setdefault((c, s), now_s)
        self.resident.clear()
        self.resident.update(fresh)
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
        """Drop one resident instance (a warm placement retired); False if it was not there."""
        services = self.resident.get(chunk)
        if not services or service not in services:
            return False
        services.remove(service)
        if not services:
            del self.resident[chunk]
        self._used_at_s.pop((chunk, service), None)
        return True

    def preload(self, chunk: Chunk, service: str) -> None:
        """Make `service` resident on `chunk` at start-up (no eviction, no cost)."""
        if not self.is_resident(chunk, service):
            self.resident.setdefault(chunk, []).append(service)
