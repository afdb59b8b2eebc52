"""The pools of a cluster: CPU nodes (cores by NUMA group, memory), GPU nodes (buddy chunks),
API pools (concurrency cap and token bucket). `ClusterState` (scheduler/resources.py) holds them."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.gpu_cache import Tier
from scheduler.images import ImageStore
from scheduler.restore_cost import SEEDED, RestoreCosts, tier_on

GPU_CHUNK_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class NumaShape:
    """What is derived from a node's NUMA layout: core -> group, and each group as a set."""

    numa: tuple[tuple[int, ...], ...]
    group_of: dict[int, int]
    groups: tuple[frozenset[int], ...]


_SHAPES: dict[int, NumaShape] = {}


def numa_shape(numa: tuple[tuple[int, ...], ...]) -> NumaShape:
    """The `NumaShape` of a layout, cached per layout object.

    Keyed by identity (copies of a `CpuNode` share its `numa` tuple): hashing a 256-core tuple
    on every lookup cost a third of a simulated round.
    """
    hit = _SHAPES.get(id(numa))
    if hit is not None and hit.numa is numa:
        return hit
    if len(_SHAPES) > 4096:
        _SHAPES.clear()
    group_of = {c: g for g, cores in enumerate(numa) for c in cores}
    _SHAPES[id(numa)] = hit = NumaShape(numa, group_of, tuple(frozenset(g) for g in numa))
    return hit


def numa_split(cores: int, groups: int, first: int = 0) -> tuple[tuple[int, ...], ...]:
    """Core ids `first..first+cores-1` in `groups` NUMA groups of `cores // groups` each, the
    last group taking the remainder: the one split of a node's cores (config and simulator)."""
    per = cores // groups
    return tuple(
        tuple(range(first + g * per, first + ((g + 1) * per if g < groups - 1 else cores)))
        for g in range(groups)
    )


@dataclass
class CpuNode:
    """A CPU node: cores grouped by NUMA node, host memory reserved per trajectory."""

    name: str
    numa: tuple[tuple[int, ...], ...]
    memory_mb: int
    free: set[int] = field(default_factory=set)
    trajectory_memory_mb: dict[str, int] = field(default_factory=dict)
    online: bool = True  # False while no worker serves the node: nothing is placed there
    # cores (tuple of ids) -> actions queued behind the action they were allocated to, to run
    # on them one after another (short CPU actions in one batch, see `ClusterState.share`)
    riders: dict[tuple[int, ...], int] = field(default_factory=dict)
    # core -> actions time-sharing it beside the action that holds it (`ClusterState.share_cores`)
    sharers: dict[int, int] = field(default_factory=dict)
    # cores whose holder ended while sharers still run there: free once the last of them ends
    vacated: set[int] = field(default_factory=set)
    # grows whenever an allocation on the node starts or ends (what caches of its running
    # allocations key on: `scheduler.policies.time_share`)
    version: int = field(default=0, compare=False, repr=False)
    # the container images it holds and fetches (`scheduler.images`); None: it reports none
    store: ImageStore | None = None

    def __post_init__(self) -> None:
        if not self.free:
            self.free = {c for group in self.numa for c in group}

    @classmethod
    def uniform(cls, name: str, cores: int, memory_mb: int, numa_groups: int = 1) -> CpuNode:
        return cls(name=name, numa=numa_split(cores, numa_groups), memory_mb=memory_mb)

    @property
    def cores(self) -> int:
        return sum(len(g) for g in self.numa)

    @property
    def memory_free_mb(self) -> int:
        return self.memory_mb - sum(self.trajectory_memory_mb.values())

    def free_in_groups(self) -> list[list[int]]:
        """Free core ids per NUMA group, each sorted (walks the smaller of the free set and the
        group: few free cores on a busy node cost little)."""
        free = self.free
        return [sorted(free & g) for g in numa_shape(self.numa).groups]

    def free_in_group(self, group: int) -> list[int]:
        """Free core ids of one NUMA group, sorted."""
        return sorted(self.free & numa_shape(self.numa).groups[group])

    def max_block(self) -> int:
        """Largest number of free cores inside one NUMA group."""
        return max((len(g) for g in self.free_in_groups()), default=0)

    def pick(self, units: int) -> tuple[int, ...] | None:
        """Free core ids for `units` cores: a single core anywhere, more within one NUMA group.

        Best fit: the group with the fewest free cores that still holds them, to keep large
        blocks available for elastic actions.
        """
        groups = [g for g in self.free_in_groups() if len(g) >= units]
        if not groups:
            return None
        best = min(groups, key=len)
        return tuple(best[:units])


@dataclass
class GpuNode:
    """A GPU node: GPUs allocated as aligned buddy chunks of 1/2/4/8 (HiveD style)."""

    name: str
    num_gpus: int
    gpu_memory_mb: int
    free: set[int] = field(default_factory=set)
    # chunk (tuple of gpu ids) -> services resident there, most recently used last
    resident: dict[tuple[int, ...], list[str]] = field(default_factory=dict)
    # chunk -> actions riding on it besides the one it was allocated to (one batch, see `share`)
    riders: dict[tuple[int, ...], int] = field(default_factory=dict)
    # chunk -> services kept in host memory only there, least recently used first (what the
    # node's worker reports, issue 38): a call placed there restores them from host memory
    # (`Tier.HOST`) instead of a cold load.
    host_resident: dict[tuple[int, ...], list[str]] = field(default_factory=dict)
    # True once the node reports (or models) a bounded host tier: a service neither resident
    # nor in `host_resident` on a chunk is cold there. False: nothing is known of host memory,
    # a miss counts as a host restore (the paper's assumption) and policies ignore the tiers.
    host_tier: bool = False
    # restore seconds per (service, tier), learned from the node's calls; None: the seeds.
    # Shared by the nodes of a cluster and by copies (policies only read it).
    restore_costs: RestoreCosts | None = None

    def __post_init__(self) -> None:
        if not self.free:
            self.free = set(range(self.num_gpus))

    def tier(self, chunk: tuple[int, ...], service: str) -> Tier:
        """Where `service`'s weights are for a call on `chunk`: device, host memory, or nowhere."""
        tier = tier_on(service, chunk, self.resident, self.host_resident)
        return Tier.HOST if tier is Tier.COLD and not self.host_tier else tier

    def restore_s(self, chunk: tuple[int, ...], service: str) -> float:
        """Expected seconds a call of `service` placed on `chunk` pays before it runs."""
        return (self.restore_costs or SEEDED).cost_s(service, self.tier(chunk, service))

    def aligned_free_chunks(self, size: int) -> list[tuple[int, ...]]:
        out = []
        for start in range(0, self.num_gpus - size + 1, size):
            chunk = tuple(range(start, start + size))
            if all(g in self.free for g in chunk):
                out.append(chunk)
        return out

    def free_chunk_counts(self) -> dict[int, int]:
        """Number of free buddy chunks per size, counting each GPU in its largest free chunk."""
        counts = {s: 0 for s in GPU_CHUNK_SIZES}
        taken: set[int] = set()
        for size in sorted(GPU_CHUNK_SIZES, reverse=True):
            for chunk in self.aligned_free_chunks(size):
                if not taken.intersection(chunk):
                    counts[size] += 1
                    taken.update(chunk)
        return counts

    def pick(self, units: int, service: str = "") -> tuple[int, ...] | None:
        """A free aligned chunk of `units` GPUs, preferring one where `service` is resident,
        then (with a host tier) one where it is kept in host memory (issue 38)."""
        chunks = self.aligned_free_chunks(units)
        if not chunks:
            return None
        for chunk in chunks:
            if service and service in self.resident.get(chunk, ()):
                return chunk
        if service and self.host_tier:
            for chunk in chunks:
                if service in self.host_resident.get(chunk, ()):
                    return chunk
        return chunks[0]


@dataclass
class ApiPool:
    """An external API: a concurrency cap and/or a token-bucket quota per time window."""

    name: str
    max_concurrency: int | None = None
    quota_per_window: int | None = None
    window_s: float = 60.0
    in_flight: int = 0
    tokens: float = -1.0
    tokens_at_s: float = 0.0

    def __post_init__(self) -> None:
        if self.tokens < 0 and self.quota_per_window is not None:
            self.tokens = float(self.quota_per_window)

    def refill(self, now_s: float) -> None:
        if self.quota_per_window is None:
            return
        rate = self.quota_per_window / self.window_s
        self.tokens = min(
            float(self.quota_per_window), self.tokens + max(0.0, now_s - self.tokens_at_s) * rate
        )
        self.tokens_at_s = max(self.tokens_at_s, now_s)

    def next_fit_s(self, quota: int, now_s: float) -> float | None:
        """Earliest time (s) at which `quota` tokens will be available, ignoring concurrency.

        None when the bucket can never hold `quota` tokens. Does not mutate the pool.
        """
        if self.quota_per_window is None:
            return now_s
        if quota > self.quota_per_window:
            return None
        rate = self.quota_per_window / self.window_s
        tokens = min(float(self.quota_per_window), self.tokens + max(0.0, now_s - self.tokens_at_s) * rate)
        if tokens >= quota:
            return now_s
        return now_s + (quota - tokens) / rate

    def fits(self, quota: int, now_s: float) -> bool:
        if self.max_concurrency is not None and self.in_flight >= self.max_concurrency:
            return False
        if self.quota_per_window is None:
            return True
        self.refill(now_s)
        return self.tokens >= quota


def copy_cpu(n: CpuNode) -> CpuNode:
    # Built then overwritten: __post_init__ treats an empty `free` as "all free".
    out = CpuNode(name=n.name, numa=n.numa, memory_mb=n.memory_mb)
    out.free = set(n.free)
    out.trajectory_memory_mb = dict(n.trajectory_memory_mb)
    out.online = n.online
    out.riders = dict(n.riders)
    out.sharers = dict(n.sharers)
    out.vacated = set(n.vacated)
    out.version = n.version
    out.store = n.store.copy() if n.store is not None else None
    return out


def copy_gpu(g: GpuNode) -> GpuNode:
    out = GpuNode(name=g.name, num_gpus=g.num_gpus, gpu_memory_mb=g.gpu_memory_mb)
    out.free = set(g.free)
    out.resident = {c: list(v) for c, v in g.resident.items()}
    out.riders = dict(g.riders)
    out.host_resident = {c: list(v) for c, v in g.host_resident.items()}
    out.host_tier = g.host_tier
    out.restore_costs = g.restore_costs
    return out
