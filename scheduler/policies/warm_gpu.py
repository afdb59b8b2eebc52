"""Warm GPU placement: restore services onto free GPU memory before their calls come.

Under evict-on-execution a service is restored when a call of it is dispatched to a chunk where
it is not resident. At low load that is most calls' first step: the GPUs are idle, memory is
free, and yet each service waits for a restore on its first call and again whenever its one
warm chunk is busy. `warm_placements` decides, each round, restores onto *free* chunks whose
memory is free (never an eviction: evict-on-execution keeps all the headroom it had), for the
services with expected demand that have no free chunk where they are resident. It only acts
when no GPU call waits after the round's allocations: under load the chunks belong to calls,
and restores happen on execution as before.

Demand is learned online (`GpuDemand`: calls started per service, decayed with a half-life,
and the number of its calls running or waiting at once, averaged over time), seeded from the services the
config (or the scenario) names, so that every known service is placed at start. A warm chunk
is at most the GPUs divided by the services' expected concurrent calls: a call runs on the
chunk its service is resident on (`gpu_aware`), so a larger chunk would make calls hold more
GPUs than the load allows (dedicated groups are sized by load the same way). When the load
grows past what an instance is sized for, `oversized` retires it (unloaded while its chunk is
free, before the round decides), so calls do not keep landing on a chunk larger than the load
allows (`gpu_aware` prefers a resident chunk of any size to a restore).

The executor copies a warm restore's weights in the background; a call that lands on the
chunk before the copy is done waits for the rest of it. On a node with a host tier (issue 38)
a warm restore goes, among the chunks that fit, to one where the service is kept in host
memory (a copy instead of a cold load).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from scheduler.gpu_cache import GpuLoad
from scheduler.model import Allocation, ResourceKind
from scheduler.pools import GPU_CHUNK_SIZES
from scheduler.resources import ClusterState

Instance = tuple[str, tuple[int, ...], str]  # (GPU node, chunk, service)


@dataclass
class GpuDemand:
    """Calls started per GPU service, decayed with `half_life_s`, and their calls at once (a
    moving average over time); `units` are each service's allowed chunk sizes. Seeded services
    start at `seed` calls."""

    units: dict[str, tuple[int, ...]] = field(default_factory=dict)
    half_life_s: float = 300.0
    seed: float = 1.0
    _count: dict[str, float] = field(default_factory=dict)
    conc_tau_s: float = 60.0
    _conc: dict[str, float] = field(default_factory=dict)
    _conc_at_s: float = 0.0
    _at_s: float | None = None  # last decay (None: not yet; the clock may be the epoch's)
    _ranked: list[str] | None = field(default=None, repr=False)  # `ranked` until counts change

    def __post_init__(self) -> None:
        for service in self.units:
            self._count.setdefault(service, self.seed)

    def observe(self, service: str, units: tuple[int, ...], now_s: float, n: int = 1) -> None:
        self._decay(now_s)
        self.units.setdefault(service, units)
        self._count[service] = self._count.get(service, 0.0) + n
        self._ranked = None

    def concurrent(self, now_s: float, calls: Mapping[str, int]) -> None:
        """Record how many calls of each service run or wait now: a moving average over time
        (time constant `conc_tau_s`) of the calls of each service at once."""
        dt = now_s - self._conc_at_s
        w = 0.0 if dt <= 0 and self._conc else 1.0 - math.exp(-max(dt, 0.0) / self.conc_tau_s)
        self._conc_at_s = max(self._conc_at_s, now_s)
        for service in set(self._conc) | set(calls):
            n = float(calls.get(service, 0))
            c = self._conc.get(service)
            self._conc[service] = n if c is None else c + w * (n - c)

    def chunk_cap(self, gpus: int, now_s: float) -> int:
        """The largest warm chunk: the GPUs over the services' expected concurrent calls."""
        ranked = self.ranked(now_s)
        calls = sum(max(1.0, self._conc.get(s, 0.0)) for s in ranked)
        return max(1, int(gpus / calls)) if calls else gpus

    def ranked(self, now_s: float) -> list[str]:
        """Services with demand, most expected first (ties by name)."""
        self._decay(now_s)
        if self._ranked is None:  # counts changed since the last ranking
            self._ranked = sorted(
                (s for s, c in self._count.items() if c > 1e-3), key=lambda s: (-self._count[s], s)
            )
        return list(self._ranked)

    def _decay(self, now_s: float) -> None:
        if self._at_s is None:
            self._at_s = now_s
        elif now_s > self._at_s:
            f = math.exp(-math.log(2) * (now_s - self._at_s) / self.half_life_s)
            for s in self._count:
                self._count[s] *= f
            self._at_s = now_s
            self._ranked = None


def oversized(
    state: ClusterState, demand: GpuDemand, instances: Iterable[Instance] | None, now_s: float
) -> list[Instance]:
    """Resident instances larger than the load now allows, on a free chunk: to unload before the
    round decides (see the module doc). `instances` None: every resident instance of `state`."""
    total = sum(g.num_gpus for n, g in state.gpu.items() if f"gpu:{n}" not in state.offline)
    cap = 2 * demand.chunk_cap(total, now_s)  # hysteresis: placed at most at the cap, kept up to twice
    if instances is None:
        if cap >= GPU_CHUNK_SIZES[-1]:
            return []  # no chunk is larger (the common case: read no instance)
        instances = (
            (n, c, s)
            for n, g in state.gpu.items()
            for c, ss in g.resident.items()
            if len(c) > cap
            for s in ss
        )
    out = []
    for node, chunk, service in instances:
        g = state.gpu.get(node)
        if (
            g is not None
            and len(chunk) > cap
            and g.free.issuperset(chunk)
            and service in g.resident.get(chunk, ())
        ):
            out.append((node, chunk, service))
    return out


def warm_placements(
    state: ClusterState,
    demand: GpuDemand,
    taken: Iterable[Allocation],
    waiting: bool,
    now_s: float,
    min_free_share: float = 0.5,
) -> list[GpuLoad]:
    """Restores to start now onto free chunks (see the module doc): at most one per service and
    per chunk, each fitting in free memory without evicting anything; none while `waiting`
    (a GPU call still waits after the round), while fewer than `min_free_share` of the online
    GPUs are free after the round (under load a warm restore only takes a chunk a call is about
    to need), or without residency tracking."""
    if waiting or not state.gpu_cache:
        return []
    free = {n: set(g.free) for n, g in state.gpu.items() if f"gpu:{n}" not in state.offline}
    for a in taken:
        if a.kind is ResourceKind.GPU and a.pool in free:
            free[a.pool].difference_update(a.unit_ids)
    total = sum(state.gpu[n].num_gpus for n in free)
    if sum(len(f) for f in free.values()) < min_free_share * total or total == 0:
        return []
    out: list[GpuLoad] = []
    ranked = demand.ranked(now_s)
    cap = min(demand.chunk_cap(total, now_s), sum(len(f) for f in free.values()) // max(1, len(ranked)))
    cap = max(1, cap)
    warm = _free_resident(state, free)
    for service in ranked:
        if service in warm:
            continue
        sizes = [u for u in demand.units.get(service, ()) if u in GPU_CHUNK_SIZES and u <= cap]
        for size in sorted(sizes, reverse=True):
            spot = _free_fitting_chunk(state, free, service, size)
            if spot is not None:
                node, chunk = spot
                free[node].difference_update(chunk)
                out.append(GpuLoad(node, chunk, service, False))
                warm = _free_resident(state, free)  # that chunk is no longer free
                break
    return out


def _free_resident(state: ClusterState, free: Mapping[str, set[int]]) -> set[str]:
    """The services resident on some chunk whose GPUs are all in `free`."""
    out: set[str] = set()
    for name, f in free.items():
        if f:
            for chunk, services in state.gpu[name].resident.items():
                if services and f.issuperset(chunk):
                    out.update(services)
    return out


def _free_fitting_chunk(
    state: ClusterState, free: Mapping[str, set[int]], service: str, size: int
) -> tuple[str, tuple[int, ...]] | None:
    """A free aligned `size`-chunk where `service` fits without evicting (most free GPUs first;
    on a node with a host tier, a chunk where the service is kept in host memory first: a
    restore from there is a copy, elsewhere a cold load)."""
    for name in sorted(free, key=lambda n: (-len(free[n]), n)):
        f = free[name]
        if len(f) < size:
            continue
        node = state.gpu[name]
        cache = state.gpu_cache.get(name)
        if cache is None:
            continue
        fits = (
            chunk
            for start in range(0, node.num_gpus - size + 1, size)
            if f.issuperset(chunk := tuple(range(start, start + size)))
            and cache.victims(chunk, service) == []
        )
        if node.host_tier:  # host-resident first (min keeps the first of equals)
            best = min(fits, key=lambda c: service not in node.host_resident.get(c, ()), default=None)
        else:
            best = next(fits, None)
        if best is not None:
            return name, best
    return None
