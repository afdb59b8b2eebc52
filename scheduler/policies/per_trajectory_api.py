"""`per-trajectory-api`: every trajectory calls its APIs itself, with no shared quota control.

API actions start as soon as they are submitted, whatever the pool's concurrency cap or quota
says (the provider, not us, enforces its limits by rejecting calls). The client side retries a
rejected call `max_retries` times with exponential back-off and gives up after `timeout_s`,
as in the paper's baseline (3 retries, 600 s). Its execution model (`api_control=False`) tells
the simulator to model provider rejections. Non-API actions are scheduled as in `fcfs-min`.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.execution import ClientRetries, ExecutionModel
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies.base import register
from scheduler.policies.fcfs_min import fcfs_prefix
from scheduler.resources import ClusterState


@register("per-trajectory-api")
class PerTrajectoryApi:
    name = "per-trajectory-api"

    def __init__(self, max_retries: int = 3, timeout_s: float = 600.0, backoff_s: float = 1.0) -> None:
        self.max_retries = max_retries
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.execution = ExecutionModel(
            api_control=False, retries=ClientRetries(max_retries, timeout_s, backoff_s)
        )

    def decide(self, queue: Sequence[QueuedAction], state: ClusterState, now_s: float) -> list[Allocation]:
        out = [
            Allocation(a.action_id, ResourceKind.API, a.target, 1)
            for a in queue
            if a.cost.key is ResourceKind.API and a.target in state.api
        ]
        others = [a for a in queue if a.cost.key is not ResourceKind.API]
        out.extend(fcfs_prefix(others, state, now_s)[0])
        return out
