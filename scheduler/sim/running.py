"""What the simulator keeps per action, and the base its parts share (`scheduler.sim.engine`).

`SimBase` declares the state that `Simulator` builds and that its execution parts
(`scheduler.sim.cpu_exec`, `scheduler.sim.gpu_exec`) read and change, with the event queue's
few operations; the parts are the `Simulator`'s base classes.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from scheduler.execution import ExecutionModel, GpuResidency
from scheduler.gpu_cache import GpuCache
from scheduler.model import Allocation, QueuedAction
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState
from scheduler.restore_cost import RestoreCosts
from scheduler.sim.cluster import ExecParams
from scheduler.sim.cpu_share import SharedNode
from scheduler.sim.gpu_share import BatchedGroup
from scheduler.sim.pods import PodStarts
from scheduler.sim.results import SimResult
from scheduler.sim.scenarios import Scenario
from scheduler.sim.shared_cores import SharedCores
from scheduler.sim.workload import SimAction

FINISH, SHARED, SUBMIT, WAKE, JOIN, FETCHED, NODE = 0, 1, 2, 3, 4, 5, 6
DEFAULT_MODEL_MB = 16_000


@dataclass(slots=True)
class Pending:
    traj: int
    step: int
    first_submit_s: float
    retries: int = 0


@dataclass(slots=True)
class Running:
    qa: QueuedAction
    alloc: Allocation
    started_s: float
    setup_s: float
    rejected: bool = False
    # exclusive CPU work (lent cores and time sharing change its speed): its finish time, the
    # share of its work left at `seg_s`, and the cores' worth it runs on since then (its own +
    # lent, less what sharers take; a sharer's share of the cores it shares)
    end_s: float | None = None
    left: float = 1.0
    seg_s: float = 0.0
    units_now: float = 0.0
    lent: int = 0  # cores on loan to it now
    lent_max: int = 0  # most cores it ever had on loan


class SimBase:
    """The simulator's state (set by `Simulator.__post_init__`) and its event queue."""

    scenario: Scenario
    params: ExecParams
    state: ClusterState
    result: SimResult
    queue: WaitingQueue
    pending: dict[str, Pending]
    running: dict[str, Running]
    model: ExecutionModel
    residency: GpuResidency
    cpu_sharing: bool
    pods: PodStarts | None
    caches: dict[str, GpuCache]
    restore_costs: RestoreCosts  # learned per (service, tier) from what the simulator charges
    learn: bool
    shared: dict[str, SharedNode]  # CPU node -> its pods' time-shared cores
    groups: dict[tuple[str, tuple[int, ...]], BatchedGroup]
    sandboxes: set[str]
    evicted: set[str]
    layer_node: dict[str, str]  # evicted trajectory -> the node that keeps its layer
    time_shared: SharedCores | None
    _next_cpu: dict[str, list[tuple[QueuedAction, Allocation]]]
    _ready_at: dict[tuple[str, tuple[int, ...], str], float]
    _events: list[tuple[float, int, int, object]]
    _seq: int
    _wakes: set[float]

    # provided by the engine and its parts, used by the others
    def _submit(self, now: float, traj_i: int, step_i: int, retry_of: str | None) -> None:
        raise NotImplementedError  # `Simulator`'s

    def _footprint_mb(self, service: str, units: int) -> int:
        raise NotImplementedError  # `GpuExecution`'s

    def _host_tier_of(self, name: str, cache: GpuCache) -> None:
        raise NotImplementedError  # `GpuExecution`'s

    def _push(self, t_s: float, kind: int, data: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t_s, kind, self._seq, data))

    def _wake(self, t_s: float) -> None:
        if t_s not in self._wakes:
            self._wakes.add(t_s)
            self._push(t_s, WAKE, None)

    def _sim_action(self, aid: str) -> SimAction:
        p = self.pending[aid]
        return self.scenario.trajectories[p.traj].steps[p.step].action

    def _reschedule_shared(self, key: str | tuple[str, tuple[int, ...]]) -> None:
        sn = self.shared[key] if isinstance(key, str) else self.groups[key]
        t = sn.next_finish_s()
        if t is not None:
            self._push(t, SHARED, (key, sn.version))
