"""Build the scheduler's resource state and the costing of actions from the deployment config."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from scheduler.images import ImageStore
from scheduler.model import Allocation, CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.resources import ApiPool, ClusterState, CpuNode, GpuNode
from scheduler.restore_cost import RestoreCosts
from scheduler.service.sandboxes import one_shot_key
from tangram_celery.common.actions import compile_memory_mb
from tangram_celery.common.config import TangramConfig
from tangram_celery.common.wire import ActionMeta, AllocationWire

IMAGE_MB_PER_S = 125.0  # a node's fetch rate when its report names none (1 Gbit/s)


def build_cluster(cfg: TangramConfig, restore_costs: RestoreCosts | None = None) -> ClusterState:
    """All pools free, shaped as the config declares (host core ids start at core_offset).

    GPU residency is tracked with the workers' memory model (a reward model's replica takes
    its `memory_mb` on every GPU of its chunk), so that the scheduler predicts what a restore
    evicts until the node reports what it holds. Every GPU node shares `restore_costs` (what
    restores cost per service and tier, learned from the completions; a fresh one if None)."""
    state = ClusterState()
    for n in cfg.nodes.cpu:
        state.cpu[n.name] = CpuNode(name=n.name, numa=n.numa_split(), memory_mb=n.memory_mb)
    costs = restore_costs if restore_costs is not None else RestoreCosts()
    for g in cfg.nodes.gpu:
        state.gpu[g.name] = GpuNode(
            name=g.name, num_gpus=g.num_gpus, gpu_memory_mb=g.gpu_memory_mb, restore_costs=costs
        )
    for a in cfg.apis:
        state.api[a.name] = ApiPool(
            name=a.name,
            max_concurrency=a.max_concurrency,
            quota_per_window=a.quota_per_window,
            window_s=a.window_s,
        )
    state.attach_gpu_caches(gpu_footprint(cfg))
    return state


def gpu_footprint(cfg: TangramConfig) -> Callable[[str, int], int]:
    """MiB a reward service's replica takes on each GPU of its chunk (the workers' model)."""
    memory_mb = {m.name: m.memory_mb for m in cfg.reward_models}
    return lambda service, _units: memory_mb.get(service, 0)


@dataclass(frozen=True)
class CpuShape:
    """The largest NUMA group (cores) and the largest memory (MiB) of any CPU node: what one
    action can get at most. Nodes join at run time, so the scheduler keeps it up to date."""

    max_group_cores: int
    max_memory_mb: int

    @classmethod
    def of_config(cls, cfg: TangramConfig) -> CpuShape:
        return cls(
            max((len(g) for n in cfg.nodes.cpu for g in n.numa_split()), default=0),
            max((n.memory_mb for n in cfg.nodes.cpu), default=0),
        )

    @classmethod
    def of_state(cls, state: ClusterState) -> CpuShape:
        return cls(
            max((len(g) for n in state.cpu.values() for g in n.numa), default=0),
            max((n.memory_mb for n in state.cpu.values()), default=0),
        )

    def widened(self, other: CpuShape) -> CpuShape:
        """The larger of both in each (a node that left may come back)."""
        return CpuShape(
            max(self.max_group_cores, other.max_group_cores), max(self.max_memory_mb, other.max_memory_mb)
        )


def max_group_cores(cfg: TangramConfig) -> int:
    """Cores of the largest NUMA group of any declared CPU node (the most one action can get)."""
    return CpuShape.of_config(cfg).max_group_cores


def _reserved_mb(meta: ActionMeta, cfg: TangramConfig, largest_mb: int) -> int:
    """Memory a code action's sandbox is reserved: its own, or its compile phase's when that is
    larger (`sandbox.compile_memory_mb`), within the largest CPU node (the action still fits)."""
    assert meta.memory_mb is not None
    need = compile_memory_mb(meta.language, meta.memory_mb, cfg.sandbox.compile_memory_mb)
    largest = largest_mb or need
    return max(meta.memory_mb, min(need, largest))


def to_queued(meta: ActionMeta, cfg: TangramConfig, shape: CpuShape | None = None) -> QueuedAction:
    """Derive the cost vector of a (checked) action from its metadata and the config, within the
    CPU nodes' `shape` (default: the declared nodes')."""
    shape = shape or CpuShape.of_config(cfg)
    if meta.type == "code":
        assert meta.cpus is not None and meta.memory_mb is not None
        lo, hi = meta.cpus
        hi = min(hi, shape.max_group_cores)
        # A test suite given as test cases is malleable: its runner's workers pull cases from
        # a shared queue, so workers can join (and leave) while it runs.
        cost = CostVector(
            ResourceKind.CPU,
            Elastic.range(lo, max(lo, hi)),
            memory_mb=_reserved_mb(meta, cfg, shape.max_memory_mb),
            malleable=meta.has_tests and hi > lo,
        )
        kind, target = ("tests" if meta.has_tests else "code"), ""
    elif meta.type == "reward":
        m = cfg.reward_model(str(meta.model))
        if m is None:
            raise ValueError(f"unknown reward model {meta.model!r}")
        if m.backend == "rule":  # a pure function of strings: one core, no sandbox, no pin
            cost = CostVector(ResourceKind.CPU, Elastic.fixed(1), sandbox=False)
        else:
            cost = CostVector(ResourceKind.GPU, Elastic(m.dop_options), gpu_memory_mb=m.memory_mb)
        kind, target = f"reward:{m.name}", m.name
    else:
        cost = CostVector(ResourceKind.API, Elastic.fixed(1), api_quota=1)
        kind, target = f"api:{meta.api}", str(meta.api)
    tid = meta.trajectory_id
    if meta.one_shot or not tid:
        tid = one_shot_key(meta.id)  # a key of its own, released when the action completes
    return QueuedAction(
        action_id=meta.id,
        trajectory_id=tid,
        cost=cost,
        submitted_s=meta.submitted_s,
        kind=kind,
        target=target,
        job_id=meta.job_id,
        priority=meta.priority,
        image=meta.image or "",  # its size: what the nodes report (`scheduler.policies.image_places`)
    )


def learn_images(state: ClusterState, reports: Mapping[str, Mapping[str, Any]]) -> None:
    """What each CPU node's worker reports in `tangram:images` (held images with their
    sizes in bytes, the images it can fetch, the trajectories whose layers it keeps) becomes
    the node's image store (`scheduler.images`); a node that reports nothing keeps none, and is
    placed on as before images. An unreadable report is left out."""
    for node, report in reports.items():
        cpu = state.cpu.get(node)
        try:
            held = {str(r): max(1, int(b) // 1_000_000) for r, b in report.get("held", [])}
            fetchable = report.get("fetchable")
            can = None if fetchable is None else frozenset(map(str, fetchable)) | frozenset(held)
            layers = {str(t) for t in report.get("layers", [])}
            mb_per_s = float(report.get("fetch_mb_per_s", IMAGE_MB_PER_S))
            budget = report.get("budget_bytes")
        except (TypeError, ValueError, AttributeError):
            continue
        if cpu is None:
            continue
        if cpu.store is None:
            cpu.store = ImageStore(None, mb_per_s)
        cpu.store.mb_per_s = mb_per_s
        cpu.store.budget_mb = None if budget is None else int(budget) // 1_000_000
        cpu.store.learn(held, can, layers)


def alloc_to_wire(alloc: Allocation) -> AllocationWire:
    return AllocationWire(
        action_id=alloc.action_id,
        kind=alloc.kind.value,
        pool=alloc.pool,
        units=alloc.units,
        unit_ids=alloc.unit_ids,
        evict=alloc.evict,
        shares=alloc.shares,
    )


def alloc_from_wire(w: AllocationWire) -> Allocation:
    return Allocation(w.action_id, ResourceKind(w.kind), w.pool, w.units, w.unit_ids, w.evict, w.shares)
