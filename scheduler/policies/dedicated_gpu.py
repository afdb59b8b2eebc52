"""`dedicated-gpu`: each reward service owns one fixed tensor-parallel group.

Like one SGLang server per teacher: at start every service (sorted by name) is given the next
aligned `tp`-GPU chunk, node by node; its model stays resident there, so there is never a
restore, but no other service may use those GPUs. A service's actions run one at a time on its
group (FCFS per service), at `tp` units. Services without a group never run; more groups than
services leaves GPUs idle. Non-GPU actions are scheduled as in `fcfs-min`.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies.base import register
from scheduler.policies.fcfs_min import fcfs_prefix
from scheduler.resources import ClusterState


def dedicated_groups(
    state: ClusterState, services: Sequence[str], tp: int
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """service -> (gpu node, chunk), assigned in name order over nodes in name order."""
    slots = [
        (name, tuple(range(start, start + tp)))
        for name in sorted(state.gpu)
        for start in range(0, state.gpu[name].num_gpus - tp + 1, tp)
    ]
    return dict(zip(sorted(services), slots, strict=False))


@register("dedicated-gpu")
class DedicatedGpu:
    """`services` are the reward services to host; `tp` their tensor-parallel degree."""

    name = "dedicated-gpu"
    gpu_residency = "dedicated"

    def __init__(self, services: Sequence[str] = (), tp: int = 4) -> None:
        self.services = list(services)
        self.tp = tp

    def decide(self, queue: Sequence[QueuedAction], state: ClusterState, now_s: float) -> list[Allocation]:
        services = self.services or sorted({a.target for a in queue if a.cost.key is ResourceKind.GPU})
        groups = dedicated_groups(state, services, self.tp)
        taken: set[str] = set()
        out: list[Allocation] = []
        others: list[QueuedAction] = []
        for action in queue:
            if action.cost.key is not ResourceKind.GPU:
                others.append(action)
                continue
            slot = groups.get(action.target)
            if slot is None or action.target in taken:
                continue
            node, chunk = slot
            taken.add(action.target)
            if state.gpu[node].free.issuperset(chunk):
                out.append(Allocation(action.action_id, ResourceKind.GPU, node, self.tp, chunk))
        out.extend(fcfs_prefix(others, state, now_s)[0])
        return out
