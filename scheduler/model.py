"""The action model as the scheduler sees it: metadata only, never payloads.

A rollout-side action (code run, reward scoring, API call) is reduced to a `QueuedAction`:
who it belongs to, what it costs, how long it is expected to take at each unit count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from scheduler.duration import ElasticityCurve, Rigid


class ResourceKind(StrEnum):
    """The type of an action's key resource, which is also the family of queues it goes to."""

    CPU = "cpu"
    GPU = "gpu"
    API = "api"


@dataclass(frozen=True, slots=True)
class Elastic:
    """Unit counts an action accepts for its key resource, ascending (e.g. 1..8 or {1,2,4,8})."""

    units: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.units:
            raise ValueError("Elastic needs at least one unit count")
        if any(u < 1 for u in self.units):
            raise ValueError(f"unit counts must be >= 1, got {self.units}")
        if list(self.units) != sorted(set(self.units)):
            object.__setattr__(self, "units", tuple(sorted(set(self.units))))

    @classmethod
    def fixed(cls, n: int = 1) -> Elastic:
        return cls((n,))

    @classmethod
    def range(cls, lo: int, hi: int) -> Elastic:
        if hi < lo:
            raise ValueError(f"empty unit range {lo}..{hi}")
        return cls(tuple(range(lo, hi + 1)))

    @property
    def min(self) -> int:
        return self.units[0]

    @property
    def max(self) -> int:
        return self.units[-1]

    @property
    def is_elastic(self) -> bool:
        return len(self.units) > 1


@dataclass(frozen=True, slots=True)
class CostVector:
    """What an action needs. `units` counts the key resource (cores, GPUs or API slots).

    `memory_mb` is host memory the action's sandbox needs (for CPU actions it is reserved for
    the trajectory on its node while its sandbox lives, raised when a later action asks for
    more; an idle trajectory's reservation can be evicted, see `Allocation.evict`);
    `gpu_memory_mb` is the footprint of the service on GPU; `api_quota` is the number of quota
    tokens one call consumes. `sandbox` is False for a CPU
    action that needs no trajectory sandbox (a rule-based verifier): it runs on any node, and
    neither pins its trajectory nor reserves memory.
    `malleable`: the action can take more cores while it runs, and give them back (a test suite
    given as `test_cases`: the runner's workers pull cases from a shared queue, so workers can
    join or leave mid-run). A `pytest -n K` run is not: its DoP is fixed once started.
    """

    key: ResourceKind
    units: Elastic = field(default_factory=Elastic.fixed)
    memory_mb: int = 0
    gpu_memory_mb: int = 0
    api_quota: int = 0
    sandbox: bool = True
    malleable: bool = False


@dataclass(slots=True)
class QueuedAction:
    """A waiting action as the policy sees it.

    `target` names the pool family member: the API name for API actions, the service (reward
    model) name for GPU actions, empty for CPU actions (any CPU node, sticky per trajectory).
    `kind` keys the duration profile (e.g. "code", "tests", "reward:rm", "api:search").
    `t1_s` is the expected duration at one unit; `dur(m) = t1_s / (E(m) * m)`.
    """

    action_id: str
    trajectory_id: str
    cost: CostVector
    submitted_s: float
    t1_s: float = 1.0
    efficiency: ElasticityCurve = field(default_factory=Rigid)
    kind: str = "code"
    target: str = ""
    job_id: str = "default"
    priority: int = 0
    # never a rider: it was handed back from a batch once (live only; `cpu_batch`)
    solo: bool = False
    # the trajectory's container image ("": the host toolchain) and its size in MB, where known
    # (`scheduler.images`): a new sandbox in it starts once its node holds the image
    image: str = ""
    image_mb: int = 0

    def duration_s(self, units: int) -> float:
        """Expected execution time in seconds at `units` units of the key resource."""
        return self.t1_s / (self.efficiency.efficiency(units) * units)


@dataclass(slots=True, unsafe_hash=True)
class Allocation:
    """A policy decision: start `action_id` on `pool` with `units` units (the DoP).

    `unit_ids` are the concrete core ids (CPU) or GPU ids (a buddy chunk); empty for API pools.
    `evict` names idle trajectories pinned to the CPU node `pool` whose sandboxes are removed,
    and their memory reservations released, to make room for this action (memory is a cache:
    `ClusterState.apply` does it; the executor removes the sandboxes).
    `shares`: a CPU action that time-shares `unit_ids`, cores held by a running action, beside
    it (`scheduler.policies.time_share`; `ClusterState.share_cores` applies it).
    A value: never changed once made (hashable for that reason). Not `frozen=True` only because
    a frozen dataclass costs 4x as much to build, and a round builds one per decision.
    """

    action_id: str
    kind: ResourceKind
    pool: str
    units: int
    unit_ids: tuple[int, ...] = ()
    evict: tuple[str, ...] = ()
    shares: bool = False

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "action_id": self.action_id,
            "kind": str(self.kind),
            "pool": self.pool,
            "units": self.units,
            "unit_ids": list(self.unit_ids),
        }
        if self.evict:
            out["evict"] = list(self.evict)
        if self.shares:
            out["shares"] = True
        return out

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Allocation:
        ids = d.get("unit_ids") or []
        evict = d.get("evict") or []
        assert isinstance(ids, list) and isinstance(evict, list)
        return cls(
            action_id=str(d["action_id"]),
            kind=ResourceKind(str(d["kind"])),
            pool=str(d["pool"]),
            units=int(str(d["units"])),
            unit_ids=tuple(int(i) for i in ids),
            evict=tuple(str(t) for t in evict),
            shares=d.get("shares") is True,
        )
