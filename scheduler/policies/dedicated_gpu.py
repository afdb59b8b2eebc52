"""`dedicated-gpu`: each reward service owns fixed GPU groups, like one SGLang deployment per teacher.

At start every service gets its groups (aligned `tp`-GPU chunks, node by node, services in name
order); its model stays resident there, so there is never a restore, but no other service may
use those GPUs. The configuration knobs are what an operator sizing such a deployment has:

- `tp`: GPUs per group (tensor parallel). A model whose weights and one call's memory do not fit
  on `tp` GPUs gets the smallest chunk size that holds it (for every service alike).
- `replicas`: "one" group per service (the paper's baseline), or "load": data-parallel replicas
  sized by each service's expected load (`loads`, GPU-seconds at one GPU: D'Hondt over the
  groups the cluster has, at least one each), as SGLang's `--dp` behind its router does.
- `max_concurrent`: calls one group serves at once. 1 is one call at a time (FCFS per service);
  None is as many as its memory holds, `(gpu_memory - weights / group size) // call_memory_mb`,
  as a continuously batching server (SGLang) admits running requests while KV memory lasts; an
  int caps that. How fast concurrent calls run is the simulator's execution model
  (`ExecParams.batch_amortised_share`, docs/simulator.md).

Within a service calls are FCFS; each goes to the group with the fewest calls in flight that
still has room (the router's least-load choice). Non-GPU actions are scheduled as in `fcfs-min`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from scheduler.execution import ExecutionModel, GpuResidency
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies.base import register
from scheduler.policies.fcfs_min import fcfs_prefix
from scheduler.resources import GPU_CHUNK_SIZES, ClusterState

Slot = tuple[str, tuple[int, ...]]  # (gpu node, chunk)
REPLICAS = ("one", "load")


def dedicated_groups(
    state: ClusterState, services: Sequence[str], tp: int
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """service -> (gpu node, chunk), one each, assigned in name order over nodes in name order."""
    return dict(zip(sorted(services), chunks_of(state, tp), strict=False))


def chunks_of(state: ClusterState, size: int) -> list[Slot]:
    """Every aligned `size`-GPU chunk of the cluster, nodes in name order."""
    return [
        (name, tuple(range(start, start + size)))
        for name in sorted(state.gpu)
        for start in range(0, state.gpu[name].num_gpus - size + 1, size)
    ]


def replicas_by_load(services: Sequence[str], loads: Mapping[str, float], slots: int) -> dict[str, int]:
    """Groups per service: one each, the rest one at a time to the highest load per group
    (D'Hondt), ties to the name first. Services beyond `slots` get none."""
    names = sorted(services)
    count = {s: 1 if i < slots else 0 for i, s in enumerate(names)}
    for _ in range(max(0, slots - len(names))):
        best = max(names, key=lambda s: (loads.get(s, 0.0) / count[s], -names.index(s)))
        count[best] += 1
    return count


@register("dedicated-gpu")
class DedicatedGpu:
    """`services` to host on groups of `tp` GPUs (see the module doc for the other knobs)."""

    name = "dedicated-gpu"

    def __init__(
        self,
        services: Sequence[str] = (),
        tp: int = 4,
        replicas: str = "one",
        max_concurrent: int | None = 1,
        loads: Mapping[str, float] | None = None,
        model_mb: Mapping[str, int] | None = None,
        call_memory_mb: int = 4096,
    ) -> None:
        if tp not in GPU_CHUNK_SIZES:
            raise ValueError(f"dedicated-gpu tp must be one of {GPU_CHUNK_SIZES}, got {tp}")
        if replicas not in REPLICAS:
            raise ValueError(f"dedicated-gpu replicas must be one of {REPLICAS}, got {replicas!r}")
        if max_concurrent is not None and max_concurrent < 1:
            raise ValueError(f"dedicated-gpu max_concurrent must be >= 1 or None, got {max_concurrent}")
        self.services = list(services)
        self.tp = tp
        self.replicas = replicas
        self.max_concurrent = max_concurrent
        self.loads = dict(loads or {})
        self.model_mb = dict(model_mb or {})
        self.call_memory_mb = call_memory_mb
        self._plans: dict[tuple[tuple[str, int, int], ...], dict[str, list[Slot]]] = {}
        # its groups are resident from the start; with max_concurrent above 1 a group runs its
        # concurrent calls together (continuous batching)
        self.execution = ExecutionModel(
            gpu_residency=GpuResidency.DEDICATED, preload=self.preload, gpu_sharing=max_concurrent != 1
        )

    def preload(self, state: ClusterState, services: Sequence[str]) -> list[tuple[str, Slot]]:
        """(service, slot) of every group (`placement`), resident from the start."""
        return [(svc, slot) for svc, slots in self.placement(state, services).items() for slot in slots]

    # ---- the deployment ----------------------------------------------------------------------
    def group_size(self, gpu_memory_mb: int) -> int:
        """GPUs per group: `tp`, or the smallest chunk holding every model and one call."""
        for size in GPU_CHUNK_SIZES:
            if size >= self.tp and all(
                -(-mb // size) + self.call_memory_mb <= gpu_memory_mb for mb in self.model_mb.values()
            ):
                return size
        return GPU_CHUNK_SIZES[-1]

    def capacity(self, service: str, size: int, gpu_memory_mb: int) -> int:
        """Calls one group of `service` serves at once."""
        if self.max_concurrent == 1:
            return 1
        weights = -(-self.model_mb.get(service, 0) // size)
        fits = max(1, (gpu_memory_mb - weights) // self.call_memory_mb)
        return fits if self.max_concurrent is None else min(fits, self.max_concurrent)

    def placement(self, state: ClusterState, services: Sequence[str] = ()) -> dict[str, list[Slot]]:
        """service -> its groups, fixed for the cluster's shape (the simulator preloads them)."""
        names = sorted(self.services or services)
        shape = tuple((n, g.num_gpus, g.gpu_memory_mb) for n, g in sorted(state.gpu.items()))
        key = (*shape, ("", len(names), hash(tuple(names))))
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        memory = min((g.gpu_memory_mb for g in state.gpu.values()), default=0)
        size = self.group_size(memory) if self.model_mb else self.tp
        slots = chunks_of(state, size)
        if self.replicas == "one":
            count = {s: 1 if i < len(slots) else 0 for i, s in enumerate(names)}
        else:
            count = replicas_by_load(names, self.loads, len(slots))
        plan, it = {}, iter(slots)
        for s in names:
            plan[s] = [next(it) for _ in range(count[s])]
        self._plans[key] = plan
        return plan

    # ---- deciding ----------------------------------------------------------------------------
    def decide(self, queue: Sequence[QueuedAction], state: ClusterState, now_s: float) -> list[Allocation]:
        services = self.services or sorted({a.target for a in queue if a.cost.key is ResourceKind.GPU})
        plan = self.placement(state, services)
        in_flight: dict[Slot, int] = {}
        blocked: set[str] = set()
        out: list[Allocation] = []
        others: list[QueuedAction] = []
        for action in queue:
            if action.cost.key is not ResourceKind.GPU:
                others.append(action)
                continue
            svc = action.target
            if svc in blocked:
                continue  # FCFS within a service
            best: tuple[int, Slot] | None = None
            for slot in plan.get(svc, ()):
                node, chunk = slot
                if slot not in in_flight:
                    gnode = state.gpu[node]
                    held = not gnode.free.issuperset(chunk)
                    in_flight[slot] = (1 + gnode.riders.get(chunk, 0)) if held else 0
                room = self.capacity(svc, len(chunk), state.gpu[node].gpu_memory_mb) - in_flight[slot]
                if room > 0 and (best is None or in_flight[slot] < best[0]):
                    best = (in_flight[slot], slot)
            if best is None:
                blocked.add(svc)
                continue
            node, chunk = best[1]
            in_flight[best[1]] += 1
            out.append(Allocation(action.action_id, ResourceKind.GPU, node, len(chunk), chunk))
        out.extend(fcfs_prefix(others, state, now_s)[0])
        return out
