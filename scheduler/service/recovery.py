"""Rebuild the scheduler's in-memory state from Redis after a restart (or a Redis restart)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from scheduler.model import Allocation
from scheduler.service.cluster import to_queued
from tangram_celery.store import EVENTS, INTAKE, ActionState

if TYPE_CHECKING:
    from scheduler.service.loop import SchedulerService

log = logging.getLogger("tangram.scheduler")


def recover(svc: SchedulerService) -> None:
    """Rebuild state from Redis after a restart: running allocations, pins, pending entries."""
    running = svc.store.load_running()
    now = svc.clock()
    ids = list(running)
    states = svc.store.states(ids)
    for (action_id, rec), st in zip(running.items(), states, strict=True):
        qa = to_queued(rec["meta"], svc.cfg)
        svc.estimator.annotate(qa)
        svc.active[qa.trajectory_id] += 1
        svc.attempt[action_id] = int(rec.get("attempt", 1))
        if st == ActionState.QUEUED:  # re-routed, not yet placed again
            svc.waiting.append(qa)
            continue
        svc.state.hold(Allocation.from_dict(rec["alloc"]), qa, now)
        svc.kind_of[action_id] = qa.kind
        svc.running_qa[action_id] = qa
        if isinstance(rec.get("sandbox"), dict):
            svc.sandbox_of[action_id] = rec["sandbox"]
    svc.waiting.sort_by_submission()
    for tid, pin in svc.store.load_pins().items():
        if pin["node"] in svc.state.cpu:
            svc.state.trajectory_node[tid] = pin["node"]
            svc.state.cpu[pin["node"]].trajectory_memory_mb[tid] = int(pin["memory_mb"])
            svc.book.restore_pin(tid, pin)
    # Sandboxes of restored pins may be gone (their workers restarted too): the liveness check
    # releases those (`trajectories.reconcile`) once the workers' reports say so.
    svc.book.reset.update(svc.store.load_resets())
    # Allocated but maybe never sent (the previous run died between persist and send):
    # send again; the worker's claim turns a duplicate into a no-op.
    resend = [
        Allocation.from_dict(running[i]["alloc"])
        for i, st in zip(ids, states, strict=True)
        if st == ActionState.DISPATCHED
    ]
    if resend:
        log.info("re-sending %d dispatched action(s) after restart", len(resend))
        svc.send(resend)
    # Unacknowledged events and intake entries of the previous run, in stream (FCFS) order.
    for events in svc.store.read_pending(EVENTS):
        svc.on_events(events)
    for intake in svc.store.read_pending(INTAKE):
        svc.on_intake(intake)
