"""What workers report on the events stream: completions (units released, durations learned,
trajectories done), actions handed back or cancelled, and what GPU nodes hold."""

from __future__ import annotations

import logging
import time
from typing import Any

from scheduler.model import ResourceKind
from scheduler.service import elastic, faults, trajectories
from scheduler.service.context import Context
from tangram_celery.common.wire import Completion, EventStatus, ResidencyReport, parse_event, resident_map
from tangram_celery.store import IntakeEntry

log = logging.getLogger("tangram.scheduler")


def read_event(entry: IntakeEntry) -> Completion | ResidencyReport | None:
    """The entry's event; a malformed one is logged and, when it names an action, taken as an
    `error` completion (its units must come back all the same)."""
    try:
        return parse_event(entry.fields.get("event", "{}"))
    except ValueError as e:
        log.warning("malformed event %s: %s: %.200s", entry.stream_id, e, entry.fields.get("event"))
        return Completion(status=EventStatus.ERROR) if entry.fields.get("id") else None


def on_events(ctx: Context, events: list[IntakeEntry]) -> None:
    if not events:
        return
    state, books = ctx.state, ctx.books
    done: list[str] = []
    owners: dict[str, dict[str, Any]] = {}  # pin records whose sandbox owner changed
    for e in events:
        action_id = e.fields.get("id", "")
        ev = read_event(e)
        if isinstance(ev, ResidencyReport):
            elastic.learn_residency(ctx, ev.pool, resident_map(ev.resident), ev.warm, ev.error)
            continue
        if ev is None:
            continue
        if ev.status is EventStatus.RETRY:
            faults.retry_elsewhere(ctx, action_id, ev.error, unstarted=ev.unstarted)
            continue
        if ev.status is EventStatus.CANCELLED:
            faults.drop_cancelled(ctx, action_id)
            continue
        alloc = state.release(action_id, ctx.clock())  # a use of its trajectory (eviction order)
        if alloc is None:
            continue  # not running here: refused or replayed
        if alloc.kind is ResourceKind.GPU and ev.resident is not None:
            elastic.learn_residency(ctx, alloc.pool, resident_map(ev.resident))
        done.append(action_id)
        qa = books.forget(action_id)
        ctx.recorder.completed(qa, alloc, ev)
        if qa is not None and ev.status.ran and ev.exec_s:
            exec_s: float | None = ev.exec_s
            if alloc.shares:  # slowed by sharing: what it takes alone is the CPU time it used
                exec_s = ev.cpu_s / alloc.units if ev.cpu_s else None
            if exec_s:
                ctx.estimator.observe(qa.kind, alloc.units, exec_s)
        # the scheduler's own key (a one-shot action's is not in the event)
        tid = qa.trajectory_id if qa is not None else ev.trajectory_id
        if not tid:
            continue
        if (
            alloc.kind is ResourceKind.CPU
            and state.trajectory_node.get(tid) == alloc.pool
            and books.sandboxes.completed(tid, ev.worker, ev.seq)
        ):
            owners[tid] = trajectories.pin_record(ctx, tid)
        trajectories.done(ctx, tid)
    ctx.store.events_done(
        done, {t: r for t, r in owners.items() if t in state.trajectory_node}, [e.stream_id for e in events]
    )
    ctx.progress_s = time.monotonic()
    trajectories.close_ready(ctx)
