"""Build the scheduler's resource state and the costing of actions from the deployment config."""

from __future__ import annotations

from typing import Any

from scheduler.model import CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.resources import ApiPool, ClusterState, CpuNode, GpuNode
from scheduler.service.sandboxes import one_shot_key
from tangram_celery.config import TangramConfig


def build_cluster(cfg: TangramConfig) -> ClusterState:
    """All pools free, shaped as the config declares (host core ids start at core_offset)."""
    state = ClusterState()
    for n in cfg.nodes.cpu:
        per = n.cores // n.numa_groups
        ids = list(range(n.core_offset, n.core_offset + n.cores))
        groups = tuple(
            tuple(ids[g * per : (g + 1) * per if g < n.numa_groups - 1 else n.cores])
            for g in range(n.numa_groups)
        )
        state.cpu[n.name] = CpuNode(name=n.name, numa=groups, memory_mb=n.memory_mb)
    for g in cfg.nodes.gpu:
        state.gpu[g.name] = GpuNode(name=g.name, num_gpus=g.num_gpus, gpu_memory_mb=g.gpu_memory_mb)
    for a in cfg.apis:
        state.api[a.name] = ApiPool(
            name=a.name,
            max_concurrency=a.max_concurrency,
            quota_per_window=a.quota_per_window,
            window_s=a.window_s,
        )
    return state


def pool_view(cfg: TangramConfig) -> dict[str, Any]:
    """What a client needs to reject impossible actions at submit (published in Redis)."""
    return {
        "max_cpus": max(
            (max(len(g) for g in _groups(n.cores, n.numa_groups)) for n in cfg.nodes.cpu), default=0
        ),
        "max_memory_mb": max((n.memory_mb for n in cfg.nodes.cpu), default=0),
        "models": {m.name: {"backend": m.backend, "max_batch": m.max_batch} for m in cfg.reward_models},
        "apis": [a.name for a in cfg.apis],
        "max_queued": cfg.scheduler.max_queued,
        "limits": cfg.limits.model_dump(mode="json"),
        "admit_memory_fraction": cfg.broker.admit_memory_fraction,
    }


def _groups(cores: int, numa: int) -> list[range]:
    per = cores // numa
    return [range(g * per, (g + 1) * per if g < numa - 1 else cores) for g in range(numa)]


def check_meta(meta: dict[str, Any], view: dict[str, Any]) -> str | None:
    """Why an action can never run on this deployment, or None if it can."""
    t = meta.get("type")
    if t == "code":
        lo = meta["cpus"][0]
        if view["max_cpus"] == 0:
            return "no CPU node is configured (nodes.cpu is empty)"
        if lo > view["max_cpus"]:
            return f"cpus min {lo} exceeds the largest NUMA group ({view['max_cpus']} cores)"
        if meta["memory_mb"] > view["max_memory_mb"]:
            return f"memory_mb {meta['memory_mb']} exceeds every CPU node's memory"
        return None
    if t == "reward":
        if meta["model"] not in view["models"]:
            known = ", ".join(sorted(view["models"])) or "none"
            return f"unknown reward model {meta['model']!r} (configured: {known})"
        return None
    if t == "api":
        if meta["api"] not in view["apis"]:
            return f"unknown API {meta['api']!r} (configured: {', '.join(view['apis']) or 'none'})"
        return None
    return f"unknown action type {t!r}"


def to_queued(meta: dict[str, Any], cfg: TangramConfig) -> QueuedAction:
    """Derive the cost vector of a (checked) action from its metadata and the config."""
    t = meta["type"]
    if t == "code":
        lo, hi = meta["cpus"]
        hi = min(hi, max(len(g) for n in cfg.nodes.cpu for g in _groups(n.cores, n.numa_groups)))
        cost = CostVector(ResourceKind.CPU, Elastic.range(lo, max(lo, hi)), memory_mb=meta["memory_mb"])
        kind, target = ("tests" if meta.get("has_tests") else "code"), ""
    elif t == "reward":
        m = cfg.reward_model(meta["model"])
        assert m is not None
        if m.backend == "rule":  # a pure function of strings: one core, no sandbox, no pin
            cost = CostVector(ResourceKind.CPU, Elastic.fixed(1), sandbox=False)
        else:
            cost = CostVector(ResourceKind.GPU, Elastic(m.dop_options), gpu_memory_mb=m.memory_mb)
        kind, target = f"reward:{m.name}", m.name
    else:
        cost = CostVector(ResourceKind.API, Elastic.fixed(1), api_quota=1)
        kind, target = f"api:{meta['api']}", meta["api"]
    tid = meta.get("trajectory_id") or ""
    if meta.get("ephemeral") or not tid:
        tid = one_shot_key(meta["id"])  # a key of its own, released when the action completes
    return QueuedAction(
        action_id=meta["id"],
        trajectory_id=tid,
        cost=cost,
        submitted_s=float(meta["submitted_s"]),
        kind=kind,
        target=target,
        job_id=meta.get("job_id", "default"),
        priority=int(meta.get("priority", 0)),
    )
