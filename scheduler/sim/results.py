"""What a simulation run produces: one record per completed action, and summaries of them."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """One completed (or finally failed) action. Times in simulated seconds.

    `submitted_s` is the first submission (retries included in the ACT); `setup_s` is the
    part of the execution spent on sandbox start, exec overhead, restore or cold load;
    `slowed_s` how much longer its work ran than it would have alone on its own units (time
    sharing: a sharer's, or its holder's; a pod's contention), never below 0.
    """

    action_id: str
    trajectory_id: str
    kind: str
    key: str
    submitted_s: float
    started_s: float
    ended_s: float
    units: int
    setup_s: float = 0.0
    retries: int = 0
    failed: bool = False
    slowed_s: float = 0.0

    @property
    def act_s(self) -> float:
        return self.ended_s - self.submitted_s

    @property
    def queue_s(self) -> float:
        return self.started_s - self.submitted_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SimResult:
    policy: str
    scenario: str
    records: list[ActionRecord] = field(default_factory=list)
    decision_s: list[float] = field(default_factory=list)
    queue_len: list[int] = field(default_factory=list)
    trajectory_end_s: dict[str, float] = field(default_factory=dict)
    rejected_calls: int = 0
    limit_violations: int = 0
    device_hits: int = 0  # GPU allocations that found their instance resident on their chunk
    restores: int = 0  # loads from the host tier (evict on execution)
    warm_restores: int = 0  # loads ahead of demand (warm GPU placement), of either tier
    warm_unloads: int = 0  # warm instances retired when the load outgrew them
    cold_loads: int = 0  # loads from storage (cold-start; evict on execution past the host tier)
    unloads: int = 0  # instances unloaded by a keep-alive expiry or to make room (cold-start)
    evictions: int = 0  # idle trajectories whose sandbox was evicted to make room (memory)
    sandbox_resets: int = 0  # actions that found their trajectory's sandbox evicted: a fresh one
    image_fetches: int = 0  # images fetched onto CPU nodes (`scheduler.images`)
    image_fetch_mb: int = 0
    image_wait_s: float = 0.0  # seconds new sandboxes waited for their images, summed
    layer_resumes: int = 0  # evicted image trajectories resumed on their kept layer (no reset)
    time_shared: int = 0  # actions started time-sharing cores held by a running action
    node_joins: int = 0  # nodes that joined or came back (`scheduler.sim.node_events`)
    node_leaves: int = 0  # nodes drained or lost
    node_retries: int = 0  # running actions submitted again because their node was lost
    makespan_s: float = 0.0
    wall_s: float = 0.0
    unfinished: int = 0

    def avg_act_s(self, kind: str | None = None, key: str | None = None) -> float:
        acts = [
            r.act_s
            for r in self.records
            if (kind is None or r.kind == kind) and (key is None or r.key == key)
        ]
        return statistics.fmean(acts) if acts else float("nan")

    def summary(self) -> dict[str, Any]:
        """Headline figures of the run (seconds unless named otherwise)."""
        recs = self.records
        acts = sorted(r.act_s for r in recs)
        kinds = sorted({r.kind for r in recs})
        dec = sorted(self.decision_s)
        return {
            "policy": self.policy,
            "scenario": self.scenario,
            "actions": len(recs),
            "avg_act_s": statistics.fmean(acts) if acts else float("nan"),
            "p50_act_s": acts[len(acts) // 2] if acts else float("nan"),
            "p99_act_s": acts[int(len(acts) * 0.99)] if acts else float("nan"),
            "avg_queue_s": statistics.fmean(r.queue_s for r in recs) if recs else float("nan"),
            "max_wait_s": max((r.queue_s for r in recs), default=float("nan")),
            "max_trajectory_wait_s": self.max_trajectory_wait_s(),
            "max_trajectory_stall_s": self.max_trajectory_wait_s(slowed=True),
            "time_shared": self.time_shared,
            "avg_act_by_kind_s": {k: self.avg_act_s(kind=k) for k in kinds},
            "failed_actions": sum(r.failed for r in recs),
            "rejected_calls": self.rejected_calls,
            "limit_violations": self.limit_violations,
            "restores": self.restores,
            "warm_restores": self.warm_restores,
            "warm_unloads": self.warm_unloads,
            "cold_loads": self.cold_loads,
            "loads_by_tier": {"device": self.device_hits, "host": self.restores, "cold": self.cold_loads},
            "evictions": self.evictions,
            "sandbox_resets": self.sandbox_resets,
            **self._image_summary(),
            **self._node_summary(),
            "makespan_s": self.makespan_s,
            "avg_trajectory_end_s": (
                statistics.fmean(self.trajectory_end_s.values()) if self.trajectory_end_s else float("nan")
            ),
            "rounds": len(dec),
            "decision_median_ms": 1000 * dec[len(dec) // 2] if dec else 0.0,
            "decision_mean_ms": 1000 * statistics.fmean(dec) if dec else 0.0,
            "decision_p90_ms": 1000 * dec[int(len(dec) * 0.9)] if dec else 0.0,
            "decision_p99_ms": 1000 * dec[int(len(dec) * 0.99)] if dec else 0.0,
            "decision_max_ms": 1000 * dec[-1] if dec else 0.0,
            "wall_s": self.wall_s,
            "unfinished": self.unfinished,
        }

    def max_trajectory_wait_s(self, slowed: bool = False) -> float:
        """The longest a trajectory spent waiting in queues, summed over its actions (FCFS's
        argument: a starved action stalls its whole trajectory); with `slowed`, plus the time
        its actions ran slower than alone (a time sharer starts at once, but slowed)."""
        per: dict[str, float] = {}
        for r in self.records:
            per[r.trajectory_id] = per.get(r.trajectory_id, 0.0) + r.queue_s + (r.slowed_s if slowed else 0.0)
        return max(per.values(), default=float("nan"))

    def act_over_time(self, bucket_s: float) -> list[tuple[float, float]]:
        """(bucket end time, average ACT of actions completing in the bucket)."""
        buckets: dict[int, list[float]] = {}
        for r in self.records:
            buckets.setdefault(int(r.ended_s // bucket_s), []).append(r.act_s)
        return [((b + 1) * bucket_s, statistics.fmean(v)) for b, v in sorted(buckets.items())]

    def _node_summary(self) -> dict[str, Any]:
        """Nodes joining and leaving, for runs that had any (none otherwise: as before)."""
        if not (self.node_joins or self.node_leaves):
            return {}
        return {
            "node_joins": self.node_joins,
            "node_leaves": self.node_leaves,
            "node_retries": self.node_retries,
        }

    def _image_summary(self) -> dict[str, Any]:
        """The image figures, for runs that fetched images (none otherwise: as before images)."""
        if not (self.image_fetches or self.layer_resumes):
            return {}
        return {
            "image_fetches": self.image_fetches,
            "image_fetch_mb": self.image_fetch_mb,
            "image_wait_s": self.image_wait_s,
            "layer_resumes": self.layer_resumes,
        }
