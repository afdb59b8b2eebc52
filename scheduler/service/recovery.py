"""Rebuild the scheduler's in-memory state from Redis after a restart (or a Redis restart).

`recovery_plan` turns what Redis holds (dispatch records and their actions' states, pins,
resets) into a `RecoveryPlan`: a `ClusterState.restore` snapshot, the actions to queue again and
the running ones, and the messages to send again. It reads nothing itself; the loop reads, calls it and
carries the plan out (then replays the unacknowledged events and intake entries)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.estimator import DurationEstimator
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.service.cluster import CpuShape, alloc_from_wire, to_queued
from tangram_celery.common.config import TangramConfig
from tangram_celery.common.records import PinRecord
from tangram_celery.common.wire import ActionMeta, DispatchRecord, SandboxOrder
from tangram_celery.store import ActionState

log = logging.getLogger("tangram.scheduler")


@dataclass(slots=True)
class Recovered:
    """One action of the previous run: its queue entry, metadata, attempt and sandbox order."""

    qa: QueuedAction
    meta: ActionMeta
    attempt: int
    sandbox: SandboxOrder | None = None


@dataclass
class RecoveryPlan:
    """What to rebuild: `snapshot` for `ClusterState.restore` (the running allocations, their
    trajectories' pins and reservations), `queued` (re-routed, to place again), `running`
    (dispatched), `pins` (the pin records, for the sandbox book) and `resend` (dispatched
    actions whose message may never have been sent)."""

    snapshot: dict[str, Any] = field(default_factory=dict)
    queued: list[Recovered] = field(default_factory=list)
    running: list[Recovered] = field(default_factory=list)
    pins: dict[str, PinRecord] = field(default_factory=dict)
    resend: list[Allocation] = field(default_factory=list)


def recovery_plan(
    records: Mapping[str, DispatchRecord],
    states: Sequence[str | None],
    pins: Mapping[str, PinRecord],
    cfg: TangramConfig,
    estimator: DurationEstimator,
    now_s: float,
    cpu_nodes: Mapping[str, object],
    shape: CpuShape | None = None,
) -> RecoveryPlan:
    """The plan for the dispatch records `records` (their actions' states `states`, in order)
    and the pin records `pins`; `cpu_nodes` are the CPU nodes known, declared or joined (pins
    elsewhere go), `shape` theirs (default: the declared nodes')."""
    out = RecoveryPlan()
    running: list[dict[str, Any]] = []
    expected: dict[str, float] = {}
    busy: dict[str, str] = {}
    node_of: dict[str, str] = {}
    memory: dict[str, dict[str, int]] = {}
    used: dict[str, float] = {}
    for (action_id, rec), st in zip(records.items(), states, strict=True):
        qa = to_queued(rec.meta, cfg, shape)
        estimator.annotate(qa)
        got = Recovered(qa, rec.meta, rec.attempt, rec.sandbox)
        if st == ActionState.QUEUED:  # re-routed, not yet placed again
            out.queued.append(got)
            continue
        alloc = alloc_from_wire(rec.alloc)
        out.running.append(got)
        running.append(alloc.to_dict())
        expected[action_id] = now_s + qa.duration_s(alloc.units)
        busy[action_id] = qa.trajectory_id
        if alloc.kind is ResourceKind.CPU and qa.cost.sandbox:
            tid = qa.trajectory_id
            node_of.setdefault(tid, alloc.pool)  # as `apply` pins it, unless a pin record says
            memory.setdefault(alloc.pool, {}).setdefault(tid, qa.cost.memory_mb)
            used[tid] = now_s
        if st == ActionState.DISPATCHED:
            # allocated but maybe never sent (the previous run died between persist and send)
            out.resend.append(alloc)
    for tid, pin in pins.items():
        node = pin.node
        if node not in cpu_nodes:
            continue
        old = node_of.get(tid)
        if old is not None and old != node:
            memory.get(old, {}).pop(tid, None)
        node_of[tid] = node
        memory.setdefault(node, {})[tid] = pin.memory_mb
        out.pins[tid] = pin
    out.snapshot = {
        "trajectory_node": node_of,
        "trajectory_memory_mb": memory,
        "running": running,
        "expected_end_s": expected,
        "running_trajectory": busy,
        "trajectory_used_s": used,
    }
    return out
