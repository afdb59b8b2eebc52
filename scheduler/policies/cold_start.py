"""`cold-start`: load the model on demand (like ServerlessLLM), optionally kept alive after a call.

Placement is FCFS at the minimum units, as in `fcfs-min`, preferring a free chunk where the
service is still resident (ServerlessLLM's locality-aware placement). What differs is execution:
the simulator (and a live GPU worker honouring `gpu_residency`) loads the service's weights from
local storage before a call that finds no resident instance. With `keep_alive_s` = 0 the GPUs
are freed after every call (`GpuResidency.NONE`); otherwise an instance stays resident for
`keep_alive_s` after its last call ends (`KEEPALIVE`), unless a load needs its memory first
(least recently used idle instances go first). ServerlessLLM keeps a model alive after a request
in the same way. `load_from="memory"` loads from checkpoints cached in host memory (ServerlessLLM's
DRAM tier) at the restore speed instead of from local storage.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.execution import ExecutionModel, GpuResidency
from scheduler.model import Allocation, QueuedAction
from scheduler.policies.base import register
from scheduler.policies.fcfs_min import fcfs_prefix
from scheduler.resources import ClusterState


@register("cold-start")
class ColdStart:
    """`keep_alive_s`: seconds an idle instance stays loaded (0: none; inf: until evicted);
    `load_from`: "storage" (local NVMe) or "memory" (host DRAM)."""

    name = "cold-start"

    def __init__(self, keep_alive_s: float = 0.0, load_from: str = "storage") -> None:
        if not keep_alive_s >= 0:
            raise ValueError(f"cold-start keep_alive_s must be >= 0, got {keep_alive_s}")
        if load_from not in ("storage", "memory"):
            raise ValueError(f"cold-start load_from must be 'storage' or 'memory', got {load_from!r}")
        self.keep_alive_s = float(keep_alive_s)
        self.load_from = load_from
        self.execution = ExecutionModel(
            gpu_residency=GpuResidency.NONE if keep_alive_s == 0 else GpuResidency.KEEPALIVE,
            keep_alive_s=self.keep_alive_s,
            load_from="memory" if load_from == "memory" else "storage",
        )

    def decide(self, queue: Sequence[QueuedAction], state: ClusterState, now_s: float) -> list[Allocation]:
        return fcfs_prefix(queue, state, now_s)[0]
