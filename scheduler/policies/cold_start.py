"""`cold-start`: load the model on demand, keep no resident cache (like ServerlessLLM).

Placement is FCFS at the minimum units, as in `fcfs-min`; what differs is execution: the
simulator (and a live GPU worker honouring `gpu_residency = "none"`) loads the service's
weights from local storage before every action and frees the GPUs afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.model import Allocation, QueuedAction
from scheduler.policies.base import register
from scheduler.policies.fcfs_min import fcfs_prefix
from scheduler.resources import ClusterState


@register("cold-start")
class ColdStart:
    name = "cold-start"
    gpu_residency = "none"

    def decide(self, queue: Sequence[QueuedAction], state: ClusterState, now_s: float) -> list[Allocation]:
        return fcfs_prefix(queue, state, now_s)[0]
