"""`static-pod`: the Kubernetes baseline, one sandbox pod per trajectory.

Each trajectory gets a pod with a CPU *request* (0.5 core, what the K8s scheduler packs by) and
a CPU *cap* (4 cores, the CFS quota), plus its memory, held for the trajectory's whole life.
A pod is admitted to a node whose requests, memory and pod count (`max_pods`, kubelet's
`--max-pods`; None: only requests limit it) still fit: by default the one with the fewest pods
(kube-scheduler's default `LeastAllocated` scoring, `packing="spread"`), or with
`packing="binpack"` the one with the most (`MostAllocated`, the cost-saving configuration).
Pods that fit nowhere stay pending, FCFS.
Once its pod exists, an action starts at once: there is no per-action admission, the node's
cores are time-shared by every running action (the simulator models CFS as processor sharing,
see docs/simulator.md). The returned allocations carry no core ids, and `units` is the number
of threads the action runs (its maximum units, capped at the pod's cap, e.g. `pytest -n 4`).
Non-CPU actions are scheduled as in `fcfs-min`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies.base import register
from scheduler.policies.fcfs_min import fcfs_prefix
from scheduler.resources import ClusterState

PACKINGS = {"spread": 1, "binpack": -1}  # sign of the pod count in the node choice


@register("static-pod")
class StaticPod:
    """Pods of `request_cores` request and `cap_cores` cap; `cpu_sharing` tells the simulator."""

    name = "static-pod"
    cpu_sharing = True

    def __init__(
        self,
        request_cores: float = 0.5,
        cap_cores: int = 4,
        packing: str = "spread",
        max_pods: int | None = None,
    ) -> None:
        if request_cores <= 0 or cap_cores < 1:
            raise ValueError(
                f"static-pod needs request_cores > 0 and cap_cores >= 1, got {request_cores}, {cap_cores}"
            )
        if packing not in PACKINGS:
            raise ValueError(f"static-pod packing must be one of {sorted(PACKINGS)}, got {packing!r}")
        if max_pods is not None and max_pods < 1:
            raise ValueError(f"static-pod max_pods must be >= 1 or None, got {max_pods}")
        self.request_cores = request_cores
        self.cap_cores = cap_cores
        self.packing = packing
        self.max_pods = max_pods

    def threads(self, action: QueuedAction) -> int:
        """Threads an action runs inside its pod: its maximum units, at most the cap."""
        return max(action.cost.units.min, min(self.cap_cores, action.cost.units.max))

    def decide(self, queue: Sequence[QueuedAction], state: ClusterState, now_s: float) -> list[Allocation]:
        pods = Counter(state.trajectory_node.values())
        mem_free = {n: node.memory_free_mb for n, node in state.cpu.items()}
        pins: dict[str, str] = {}
        out: list[Allocation] = []
        others: list[QueuedAction] = []
        pending = False
        for action in queue:
            if action.cost.key is not ResourceKind.CPU:
                others.append(action)
                continue
            tid = action.trajectory_id
            node = state.trajectory_node.get(tid) or pins.get(tid)
            if node is None:
                if pending:
                    continue
                node = self._admit(action, state, pods, mem_free)
                if node is None:
                    pending = True  # later new pods wait behind this one
                    continue
                pins[tid] = node
            out.append(Allocation(action.action_id, ResourceKind.CPU, node, self.threads(action)))
        out.extend(fcfs_prefix(others, state, now_s)[0])
        return out

    def _admit(
        self,
        action: QueuedAction,
        state: ClusterState,
        pods: Counter[str],
        mem_free: dict[str, int],
    ) -> str | None:
        fits = [
            n
            for n, node in state.cpu.items()
            if (pods[n] + 1) * self.request_cores <= node.cores
            and mem_free[n] >= action.cost.memory_mb
            and (self.max_pods is None or pods[n] < self.max_pods)
        ]
        if not fits:
            return None
        sign = PACKINGS[self.packing]
        node = min(fits, key=lambda n: (sign * pods[n], n))
        pods[node] += 1
        mem_free[node] -= action.cost.memory_mb
        return node
