"""The live A/B's pure parts (benchmarks/live_ab.py): pod capacity and FCFS admission as
Kubernetes would do it, ACT statistics, and Tangram's per-action overhead breakdown."""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence


def pod_capacity(cores: int, memory_mb: int, request_cores: float, pod_memory_mb: int, max_pods: int) -> int:
    """Pods one node admits: CPU requests within its cores, memory within its memory, at most
    `max_pods` (kubelet's maxPods)."""
    by_cpu = math.floor(cores / request_cores + 1e-9)
    return max(0, min(by_cpu, memory_mb // pod_memory_mb, max_pods))


class PodGate:
    """FCFS admission of trajectories' pods up to `capacity`: `on_admit(k)` is called (under the
    gate's lock; it must not block) when trajectory k's pod is admitted, in request order."""

    def __init__(self, capacity: int, on_admit: Callable[[int], None]) -> None:
        if capacity < 1:
            raise ValueError(f"pod capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.on_admit = on_admit
        self._lock = threading.Lock()
        self._pending: deque[int] = deque()
        self.running: set[int] = set()
        self.admitted: list[int] = []  # in admission order

    def request(self, k: int) -> None:
        with self._lock:
            self._pending.append(k)
            self._admit()

    def release(self, k: int) -> None:
        with self._lock:
            self.running.discard(k)
            self._admit()

    def _admit(self) -> None:
        while self._pending and len(self.running) < self.capacity:
            k = self._pending.popleft()
            self.running.add(k)
            self.admitted.append(k)
            self.on_admit(k)


def act_stats(xs: Sequence[float]) -> dict[str, float]:
    s = sorted(xs)
    if not s:
        raise ValueError("no samples")

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(p * len(s)))]

    return {"n": len(s), "avg": sum(s) / len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": s[-1]}


def trajectory_waits(samples: Sequence[tuple[int, float, float]]) -> dict[str, float]:
    """The longest a trajectory spent waiting, summed over its actions (ACT minus execution;
    FCFS's argument: a starved action stalls its whole trajectory), and the longest a
    trajectory spent in its actions in all (ACT summed: a time sharer waits little but runs
    slower). `samples`: (trajectory, ACT, execution) per action, seconds."""
    if not samples:
        raise ValueError("no samples")
    wait: dict[int, float] = {}
    act: dict[int, float] = {}
    for k, act_s, exec_s in samples:
        wait[k] = wait.get(k, 0.0) + max(0.0, act_s - exec_s)
        act[k] = act.get(k, 0.0) + act_s
    return {"max_trajectory_wait_s": max(wait.values()), "max_trajectory_act_s": max(act.values())}


def overhead_breakdown(
    parts: Sequence[Mapping[str, float]], decision: Mapping[str, float], wall_s: float
) -> dict[str, float | int | None]:
    """Tangram's mean ACT split into what scheduling adds and the rest.

    Per action (epoch timestamps): `submitted` -> `dispatched_s` (persisted by the scheduler
    after its decision) -> `started_s` (claimed by the worker) -> `worker_done` -> `received`
    (by the caller), and `exec_s` (inside the sandbox). The wait before dispatch is mostly a wait
    for free cores; the part of it that is the scheduler deciding is estimated from its
    `tangram_decision_seconds` metric: its busy share of the run times the wait, plus one mean
    round (the action's own), never more than the wait.
    - decision + dispatch hop (dispatched -> claimed) = the scheduling overhead;
    - worker prep (claimed -> done, minus exec: sandbox lookup, cgroup binding, result write)
      and delivery (worker done -> caller) are reported beside it.
    """
    rounds = decision.get("count", 0.0)
    busy = decision.get("sum", 0.0) / wall_s if wall_s > 0 else 0.0
    mean_round = decision.get("sum", 0.0) / rounds if rounds else 0.0
    rows = [
        p for p in parts if {"submitted", "dispatched_s", "started_s", "worker_done", "received"} <= p.keys()
    ]
    if not rows:
        return {"actions": 0, "scheduling_share": None}
    sums = {"act": 0.0, "wait_for_cores": 0.0, "decision": 0.0, "dispatch_hop": 0.0, "worker_prep": 0.0}
    sums |= {"delivery": 0.0, "exec": 0.0}
    for p in rows:
        wait = max(0.0, p["dispatched_s"] - p["submitted"])
        decide = min(wait, busy * wait + mean_round)
        sums["act"] += p["received"] - p["submitted"]
        sums["decision"] += decide
        sums["wait_for_cores"] += wait - decide
        sums["dispatch_hop"] += max(0.0, p["started_s"] - p["dispatched_s"])
        sums["worker_prep"] += max(0.0, p["worker_done"] - p["started_s"] - p.get("exec_s", 0.0))
        sums["delivery"] += max(0.0, p["received"] - p["worker_done"])
        sums["exec"] += p.get("exec_s", 0.0)
    n = len(rows)
    means = {f"{k}_s": v / n for k, v in sums.items()}
    act = sums["act"]
    return {
        "actions": n,
        "rounds": int(rounds),
        "decision_busy_share": busy,
        "mean_round_s": mean_round,
        **means,
        "scheduling_share": (sums["decision"] + sums["dispatch_hop"]) / act if act else None,
        "decision_share": sums["decision"] / act if act else None,
        "dispatch_hop_share": sums["dispatch_hop"] / act if act else None,
        "worker_prep_share": sums["worker_prep"] / act if act else None,
        "delivery_share": sums["delivery"] / act if act else None,
        "wait_for_cores_share": sums["wait_for_cores"] / act if act else None,
        "exec_share": sums["exec"] / act if act else None,
    }
