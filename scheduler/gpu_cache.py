"""GPU "evict on execution": which services are resident on which buddy chunks, LRU eviction.

Every (service, chunk) pair is its own service instance (each DoP configuration is a separate
deployment, as in the paper). Weights of every service are backed up in host memory, so a
service that is not resident on the chunk it is given is *restored* from host memory, after
evicting the least recently used idle instances on overlapping GPUs until its per-GPU footprint
fits. Pure bookkeeping, shared by the simulator and the live GPU worker; the resident map is the
same `dict[chunk, list[service]]` shape as `GpuNode.resident` (most recently used last).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

Chunk = tuple[int, ...]
FootprintFn = Callable[[str, int], int]  # (service, units) -> MB needed on each GPU


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
        """Instances to evict (LRU first) so that `service` fits on `chunk`; None if it never can.

        Only instances overlapping `chunk` are considered: they are idle, because the chunk is
        held exclusively by the action about to run.
        """
        need = self.footprint_mb(service, len(chunk))
        if need > self.gpu_memory_mb:
            return None
        overlapping = sorted(
            (
                (self._used_at_s.get((c, s), 0.0), c, s)
                for c, services in self.resident.items()
                if set(c) & set(chunk)
                for s in services
            ),
        )
        used = {g: self.used_mb(g) for g in chunk}
        out: list[tuple[Chunk, str]] = []
        for _, c, s in overlapping:
            if all(used[g] + need <= self.gpu_memory_mb for g in chunk):
                break
            out.append((c, s))
            for g in c:
                if g in used:
                    used[g] -= self.footprint_mb(s, len(c))
        if not all(used[g] + need <= self.gpu_memory_mb for g in chunk):
            return None
        return out

    def ensure(self, chunk: Chunk, service: str, now_s: float) -> tuple[bool, list[tuple[Chunk, str]]]:
        """Make `service` resident on `chunk`: (was it a hit, instances evicted)."""
        if self.is_resident(chunk, service):
            self.touch(chunk, service, now_s)
            return True, []
        evicted = self.victims(chunk, service)
        if evicted is None:
            raise ValueError(f"service {service} does not fit on chunk {chunk}")
        for c, s in evicted:
            self.resident[c].remove(s)
            if not self.resident[c]:
                del self.resident[c]
            self._used_at_s.pop((c, s), None)
        self.resident.setdefault(chunk, []).append(service)
        self.touch(chunk, service, now_s)
        return False, evicted

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

    def preload(self, chunk: Chunk, service: str) -> None:
        """Make `service` resident on `chunk` at start-up (no eviction, no cost)."""
        if not self.is_resident(chunk, service):
            self.resident.setdefault(chunk, []).append(service)
