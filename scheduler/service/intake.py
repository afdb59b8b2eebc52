"""Admitting intake entries into the waiting queue: close requests, new actions, and the entries
that can never run (refused with a result) or cannot even be read (dead-lettered).

The metadata is checked with the same `PoolView.refusal` the clients apply at submit: a client
without the config, or an older one, may still send what cannot run here."""

from __future__ import annotations

import logging

from scheduler.service import trajectories
from scheduler.service.cluster import to_queued
from scheduler.service.context import Context
from tangram_celery.common.actions import ActionResult, ActionStatus
from tangram_celery.common.wire import ActionMeta, PoolView
from tangram_celery.store import INTAKE, IntakeEntry

log = logging.getLogger("tangram.scheduler")


def on_intake(ctx: Context, view: PoolView, intake: list[IntakeEntry]) -> None:
    """Queue the new actions of `intake` (FCFS), note close requests, refuse the rest."""
    books = ctx.books
    rejected: list[str] = []
    for e in intake:
        f = e.fields
        if f.get("control") == "close" and f.get("trajectory_id"):
            books.closing[f["trajectory_id"]] = e.stream_id
            continue
        try:
            meta = ActionMeta.model_validate_json(f["meta"])
            why = view.refusal(meta)
            qa = to_queued(meta, ctx.cfg) if why is None else None
        except (KeyError, TypeError, ValueError) as exc:  # ValidationError is a ValueError
            # Never raise out of the loop for one bad entry: recovery would read it again on
            # every restart (a crash loop). It goes to the dead-letter stream instead.
            dead_letter(ctx, e, f"malformed intake entry: {type(exc).__name__}: {exc}")
            rejected.append(e.stream_id)
            continue
        if qa is None:
            reject(ctx, meta, str(why))
            rejected.append(e.stream_id)
            continue
        if qa.action_id in ctx.waiting or qa.action_id in books.running:
            # an entry read again (the intake is at-least-once): the action is already here
            log.warning("action %s is already queued or running; duplicate intake ignored", qa.action_id)
            rejected.append(e.stream_id)
            continue
        ctx.estimator.annotate(qa)
        ctx.waiting.append(qa)
        books.entry_of[qa.action_id] = e.stream_id
        books.meta[qa.action_id] = meta
        books.active[qa.trajectory_id] += 1
    ctx.store.ack(INTAKE, rejected)
    trajectories.close_ready(ctx)


def dead_letter(ctx: Context, entry: IntakeEntry, why: str) -> None:
    """Park a malformed intake entry in the dead-letter stream and, when it names an action,
    finish that action as `rejected` with the reason (its caller is waiting)."""
    log.error("intake entry %s dead-lettered: %s", entry.stream_id, why)
    ctx.metrics.rejected.inc()
    ctx.store.dead_letter(entry.stream_id, entry.fields, why)
    action_id = entry.fields.get("id", "")
    if action_id and ctx.store.action_state(action_id) not in (None, "done"):
        res = ActionResult(action_id=action_id, status=ActionStatus.REJECTED, error=why[:2000], attempts=0)
        ctx.store.finish_unrun(action_id, res.model_dump_json(), "")


def reject(ctx: Context, meta: ActionMeta, why: str) -> None:
    """Finish an action that can never run here as `rejected`, with the reason."""
    log.warning("rejected action %s: %s", meta.id, why)
    ctx.metrics.rejected.inc()
    res = ActionResult(
        action_id=meta.id,
        trajectory_id=meta.trajectory_id,
        status=ActionStatus.REJECTED,
        error=why,
        attempts=0,
    )
    ctx.store.finish_unrun(meta.id, res.model_dump_json(), "")
