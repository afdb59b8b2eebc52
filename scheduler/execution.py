"""How a policy's decisions are *executed*: declared by the policy, read by whoever executes them.

A policy decides; an executor (the simulator, or the live workers) carries the decisions out.
Baseline systems differ from Tangram not only in what they decide but in how their decisions
run: Kubernetes pods time-share a node's cores, a dedicated GPU deployment never restores a
model, a serverless one loads it on every call, per-trajectory API clients are rejected by the
provider instead of being held back. Each policy declares this once, as a frozen
`ExecutionModel` (its `execution` attribute), instead of a handful of optional attributes that
each executor looked up by name.

The live service executes Tangram's own model (`ExecutionModel()`): exclusive core ids per
action, GPU services cached on their chunks and evicted least recently used, API limits
enforced by the scheduler, and `tangram-fast`'s core loans and warm GPU placements
(`scheduler.service.sender` sends them, the CPU and GPU workers carry them out). `live_gaps`
says why another model cannot run live, and the config refuses such a policy with that reason
(`tangram_celery.common.config`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from scheduler.resources import ClusterState

Slot = tuple[str, tuple[int, ...]]  # (GPU node, chunk)
# (cluster, services) -> (service, slot) pairs to make resident at start (dedicated groups)
Preload = Callable[["ClusterState", Sequence[str]], Sequence[tuple[str, Slot]]]


class GpuResidency(StrEnum):
    """What happens to a GPU service's weights between calls."""

    # evict on execution: resident while memory allows; a miss restores from the host tier, or
    # loads cold where the node's host memory no longer holds the instance (`gpu_cache.Tier`)
    CACHE = "cache"
    DEDICATED = "dedicated"  # fixed groups, preloaded at start, never restored
    NONE = "none"  # loaded from storage before every call, freed after it
    KEEPALIVE = "keepalive"  # loaded on demand, kept `keep_alive_s` after the last call


@dataclass(frozen=True, slots=True)
class PodStart:
    """What creating a pod costs (`static-pod`): binding rate and start-up time.

    `bind_qps` None: binding is not rate limited. `start_p50_s` 0: pods start at once (the
    simulator then charges its generic sandbox start instead).
    """

    bind_qps: float | None = 50.0
    bind_burst: int = 100
    start_p50_s: float = 1.5
    start_p99_s: float = 5.0


@dataclass(frozen=True, slots=True)
class ClientRetries:
    """How a caller retries an API call the provider rejected: at most `max_retries` times, with
    exponential back-off from `backoff_s`, giving up `timeout_s` after the first submit."""

    max_retries: int = 3
    timeout_s: float = 600.0
    backoff_s: float = 1.0


@dataclass(frozen=True, slots=True)
class TimeShareSpec:
    """Bounds of time sharing (`scheduler.policies.time_share` places the sharers).

    `max_action_s`: only kinds measured to take at most this long (seconds, at their unit
    count) share; `per_core`: sharers on one held core at once; `weight`: a sharer's sandbox
    CPU weight relative to its host's (the default weight); `min_share`: the least share of
    each of its cores a sharer may be placed with (its expected slow-down at most
    1 / min_share); `max_holder_loss`: the most of a host's cores' worth its sharers take in all
    (a fraction of its cores).
    """

    max_action_s: float = 5.0
    per_core: int = 1
    weight: float = 0.25
    min_share: float = 0.5
    max_holder_loss: float = 0.125

    def __post_init__(self) -> None:
        if (
            self.max_action_s <= 0
            or self.per_core < 1
            or not 0 < self.weight <= 1
            or not 0 < self.min_share <= 1
            or not 0 < self.max_holder_loss < 1
        ):
            raise ValueError(f"bad time-share bounds: {self}")


@dataclass(frozen=True, slots=True)
class ExecutionModel:
    """How the decisions of one policy run (the defaults are Tangram's own model).

    cpu_sharing: actions of a node time-share its cores (pods; allocations carry no core ids),
        each using at most `cap_cores`; `pod_start` is what creating a trajectory's pod costs
        (None: a generic sandbox start).
    gpu_residency: see `GpuResidency`; `keep_alive_s` for KEEPALIVE; `load_from` the tier a
        NONE or KEEPALIVE load reads ("storage", or "memory": host DRAM at restore speed; CACHE
        reads the tier its instance is in); `preload` the service groups resident from the
        start (DEDICATED).
    gpu_sharing: concurrent calls of one GPU group run together (continuous batching).
    api_control: the scheduler enforces API limits (False: calls go out as they come and the
        provider rejects those over its limits; callers retry per `retries`).
    lend_cores: spare cores are lent to running malleable actions each round and taken back
        when an allocation needs them (`scheduler.policies.malleable`; `RoundPlan.lends`). Both
        executors carry them out: the simulator by the duration curve, the live service by
        resizing the running suite's cpuset and its runner's DoP (`scheduler.service.sender`).
    warm_gpu: services are restored onto free GPU memory ahead of their calls while no GPU call
        waits (`scheduler.policies.warm_gpu`; `RoundPlan.warm`, `Round.retire`). Both executors
        carry them out (live: the GPU worker loads the replica on the chunk).
    fetch_images: the round fetches the images of queued new trajectories ahead, onto nodes
        whose stores lack them (`scheduler.round.fetch`; `RoundPlan.fetches`); every executor
        fetches a missing image when a new sandbox needs it, whatever the policy.
    time_share: short rigid CPU actions time-share cores held by a running action, within these
        bounds (`scheduler.policies.time_share`; `RoundPlan.sharers`, `Allocation.shares`); None:
        never. Both executors carry them out with the spec's CPU weights: the simulator shares
        the cores by them, the CPU worker binds the sharer to the held cores and writes the two
        sandboxes' cgroup CPU weights for as long as they share.
    """

    cpu_sharing: bool = False
    cap_cores: float = 4.0
    pod_start: PodStart | None = None
    gpu_residency: GpuResidency = GpuResidency.CACHE
    keep_alive_s: float = 0.0
    load_from: Literal["storage", "memory"] = "storage"
    preload: Preload | None = field(default=None, compare=False)
    gpu_sharing: bool = False
    api_control: bool = True
    retries: ClientRetries = ClientRetries()
    lend_cores: bool = False
    warm_gpu: bool = False
    time_share: TimeShareSpec | None = None
    fetch_images: bool = False

    def live_gaps(self) -> list[str]:
        """Why the live service cannot execute this model ([] when it can)."""
        gaps = []
        if self.cpu_sharing:
            gaps.append("it time-shares cores between pods, and its allocations name no cores")
        if self.time_share is not None and self.cpu_sharing:
            gaps.append("it time-shares pods' cores and bounded sharers at once")
        if self.gpu_residency is not GpuResidency.CACHE:
            gaps.append(f"its GPU services are {self.gpu_residency.value!r}, the GPU workers only cache")
        if self.gpu_sharing:
            gaps.append("it runs concurrent calls of a dedicated GPU group together")
        if not self.api_control:
            gaps.append("it leaves API limits to the provider, the scheduler always enforces them")
        return gaps


TANGRAM = ExecutionModel()  # what the live service executes
# tangram-fast's: spare cores lent to malleable actions, GPU services placed ahead of demand
TANGRAM_FAST = ExecutionModel(lend_cores=True, warm_gpu=True)


def execution_of(policy: object) -> ExecutionModel:
    """The execution model `policy` declares (its `execution`), Tangram's own if it declares none.

    A TypeError names a policy whose `execution` is not an `ExecutionModel`."""
    model = getattr(policy, "execution", TANGRAM)
    if not isinstance(model, ExecutionModel):
        raise TypeError(f"policy {getattr(policy, 'name', policy)!r}: execution must be an ExecutionModel")
    return model
