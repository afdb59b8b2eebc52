"""`tangram-dp`: the paper's Algorithms 1-4, implemented as written.

1. Candidates: the longest FCFS prefix (per pool family) that fits at minimum units, placed
   topology-aware (`ClusterState.place`: NUMA group best fit for CPU, aligned buddy chunk for GPU).
2. Per pool with an elastic candidate: drop-tail search. For t = 0, 1, ... candidates dropped
   from the tail, the exact DP (`scheduler.dp`) gives the kept candidates' units, and the
   objective is their durations plus the completion-heap estimate (with `depth`) of everyone
   still waiting; stop at the first t that does not improve.
3. Pools without elastic candidates start everyone at the minimum.

Each drop step re-runs the DP, as in the paper: O(n) DPs of O(n * R * m) per pool.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.execution import TANGRAM
from scheduler.model import Allocation, QueuedAction
from scheduler.policies.base import register
from scheduler.policies.elastic import dp_cpu_solver, dp_gpu_solver, elastic_round
from scheduler.policies.fcfs_min import fcfs_prefix
from scheduler.resources import ClusterState


@register("tangram-dp")
class TangramDp:
    """The paper's scheduler. `depth` is Algorithm 2's look-ahead for the first waiting action."""

    name = "tangram-dp"
    execution = TANGRAM

    def __init__(self, depth: int = 2) -> None:
        self.depth = depth

    def decide(self, queue: Sequence[QueuedAction], state: ClusterState, now_s: float) -> list[Allocation]:
        cands, _ = fcfs_prefix(queue, state, now_s)
        return elastic_round(queue, state, now_s, cands, dp_cpu_solver, dp_gpu_solver, self.depth)
