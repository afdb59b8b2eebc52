"""`static-pod`: the Kubernetes baseline, one sandbox pod per trajectory, at a default cluster's
settings (each one cited in docs/simulator.md).

Each trajectory gets a pod with a CPU *request* (0.5 core, what the K8s scheduler packs by) and
a CPU *cap* (4 cores, the CFS quota), plus its memory, held for the trajectory's whole life.
A pod is admitted to a node whose requests, memory and pod count (`max_pods`, kubelet's
`maxPods`, default 110) still fit, the node chosen as kube-scheduler scores it:
`packing="spread"` is its default `NodeResourcesFit` strategy `LeastAllocated` (cpu and memory
weight 1, integer scores 0-100, ties broken at random), `packing="binpack"` is `MostAllocated`
(the cost-saving configuration). Pods that fit nowhere stay pending, FCFS.
Once its pod exists, an action starts at once: there is no per-action admission, the node's
cores are time-shared by every running action (the simulator models CFS as processor sharing,
see docs/simulator.md). The returned allocations carry no core ids, and `units` is the number
of threads the action runs (its maximum units, capped at the pod's cap, e.g. `pytest -n 4`).
Non-CPU actions are scheduled as in `fcfs-min`.

What a pod costs to create is part of its execution model (`ExecutionModel.pod_start`):
the scheduler binds pods at most `bind_qps` per second after a burst of `bind_burst` (its API
client's QPS 50 / burst 100), and a bound pod starts in a lognormal time with median
`start_p50_s` and 99th percentile `start_p99_s` (the scalability SLO: p99 <= 5 s, images
pre-pulled; a pod whose node lacks its image pulls it first, `scheduler.images`).
A pod in a container image is also scored by ImageLocality at its defaults (weight 1 beside
NodeResourcesFit's; `image_locality_score`). `all-at-once` is the same without admission.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Sequence

from scheduler.execution import ExecutionModel, PodStart
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies.base import register
from scheduler.policies.fcfs_min import fcfs_prefix
from scheduler.resources import ClusterState

MB = 1024 * 1024
IMAGE_MIN_BYTES = 23 * MB  # imagelocality's minThreshold
IMAGE_MAX_BYTES = 1000 * MB  # its maxContainerThreshold, times the pod's one container
PACKINGS = ("spread", "binpack")  # kube-scheduler's LeastAllocated / MostAllocated scoring
MAX_NODE_SCORE = 100  # framework.MaxNodeScore


@register("static-pod")
class StaticPod:
    """Pods of `request_cores` request and `cap_cores` cap; its execution model time-shares cores."""

    name = "static-pod"

    def __init__(
        self,
        request_cores: float = 0.5,
        cap_cores: int = 4,
        packing: str = "spread",
        max_pods: int | None = 110,
        bind_qps: float | None = 50.0,
        bind_burst: int = 100,
        start_p50_s: float = 1.5,
        start_p99_s: float = 5.0,
    ) -> None:
        if request_cores <= 0 or cap_cores < 1:
            raise ValueError(
                f"static-pod needs request_cores > 0 and cap_cores >= 1, got {request_cores}, {cap_cores}"
            )
        if packing not in PACKINGS:
            raise ValueError(f"static-pod packing must be one of {sorted(PACKINGS)}, got {packing!r}")
        if max_pods is not None and max_pods < 1:
            raise ValueError(f"static-pod max_pods must be >= 1 or None, got {max_pods}")
        if (bind_qps is not None and bind_qps <= 0) or bind_burst < 1:
            raise ValueError(
                f"static-pod needs bind_qps > 0 (or None) and bind_burst >= 1, got {bind_qps}, {bind_burst}"
            )
        if start_p50_s < 0 or (start_p50_s > 0 and start_p99_s < start_p50_s):
            raise ValueError(
                f"static-pod needs 0 <= start_p50_s <= start_p99_s, got {start_p50_s}, {start_p99_s}"
            )
        self.request_cores = request_cores
        self.cap_cores = cap_cores
        self.packing = packing
        self.max_pods = max_pods
        self.pod_start = PodStart(bind_qps, bind_burst, start_p50_s, start_p99_s)
        self.execution = ExecutionModel(
            cpu_sharing=True, cap_cores=float(cap_cores), pod_start=self.pod_start
        )

    def threads(self, action: QueuedAction) -> int:
        """Threads an action runs inside its pod: its maximum units, at most the cap."""
        return max(action.cost.units.min, min(self.cap_cores, action.cost.units.max))

    def decide(self, queue: Sequence[QueuedAction], state: ClusterState, now_s: float) -> list[Allocation]:
        pods = Counter(state.trajectory_node.values())
        mem_used = {n: node.memory_mb - node.memory_free_mb for n, node in state.cpu.items()}
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
                node = self._admit(action, state, pods, mem_used)
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
        mem_used: dict[str, int],
    ) -> str | None:
        """The node kube-scheduler binds the trajectory's new pod to, or None (Pending)."""
        mem = action.cost.memory_mb
        best: tuple[int, int, str] | None = None
        for n, node in state.cpu.items():
            cpu_req = (pods[n] + 1) * self.request_cores
            if (
                not node.online
                or cpu_req > node.cores
                or mem_used[n] + mem > node.memory_mb
                or (self.max_pods is not None and pods[n] >= self.max_pods)
            ):
                continue  # the Filter phase: NodeResourcesFit and the kubelet's pod limit
            score = (
                self._score(cpu_req * 1000, node.cores * 1000)
                + self._score(mem_used[n] + mem, node.memory_mb)
            ) // 2
            if action.image:  # ImageLocality, weight 1 beside NodeResourcesFit's
                score += image_locality_score(state, n, action.image)
            # selectHost picks at random among the top-scored nodes: a hash keeps it reproducible
            tie = zlib.crc32(f"{action.trajectory_id}/{n}".encode())
            if best is None or (score, tie) > best[:2]:
                best = (score, tie, n)
        if best is None:
            return None
        node_name = best[2]
        pods[node_name] += 1
        mem_used[node_name] += mem
        return node_name

    def _score(self, requested: float, capacity: float) -> int:
        """One resource's integer score 0-100, as `leastRequestedScore` / `mostRequestedScore`."""
        if capacity <= 0 or requested > capacity:
            return 0
        if self.packing == "spread":
            return int((capacity - requested) * MAX_NODE_SCORE // capacity)
        return int(requested * MAX_NODE_SCORE // capacity)


def image_locality_score(state: ClusterState, node: str, image: str) -> int:
    """kube-scheduler's ImageLocality score (0-100) of `node` for a one-container pod in
    `image` (pkg/scheduler/framework/plugins/imagelocality): the image's size, if the node holds
    it, scaled by the share of nodes that hold it (against "node heating"), clamped to 23 MB ..
    1000 MB and normalised. A node holds what its store holds (not what it is still fetching:
    the kubelet reports pulled images)."""
    store = state.cpu[node].store
    if store is None or image not in store.held:
        return 0
    total = len(state.cpu)
    having = sum(1 for n in state.cpu.values() if n.store is not None and image in n.store.held)
    scaled = int(store.held[image] * MB * (having / total))
    clamped = min(max(scaled, IMAGE_MIN_BYTES), IMAGE_MAX_BYTES)
    return MAX_NODE_SCORE * (clamped - IMAGE_MIN_BYTES) // (IMAGE_MAX_BYTES - IMAGE_MIN_BYTES)


@register("all-at-once")
class AllAtOnce(StaticPod):
    """Every trajectory's sandbox at once, every action started when it comes, all of them
    time-sharing the nodes' cores under CFS (processor sharing, each action at most `cap_cores`):
    what a SandboxFusion deployment or a plain harness does (the live A/B's `pod_all`). Its
    sandboxes are placed as `static-pod` places pods (spread, ImageLocality), but nothing limits
    how many a node takes (only its memory), and there is no API binding or kubelet start-up:
    a sandbox takes `start_s` to start (a cold `docker run`, the simulator's generic sandbox
    start), after the pull of an image its node lacks."""

    name = "all-at-once"

    def __init__(self, cap_cores: int = 4, packing: str = "spread", start_s: float = 0.3) -> None:
        super().__init__(
            request_cores=1e-9,
            cap_cores=cap_cores,
            packing=packing,
            max_pods=None,
            bind_qps=None,
            start_p50_s=start_s,
            start_p99_s=start_s,
        )
