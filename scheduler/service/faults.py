"""Carrying out what went wrong: lost workers and pools (a `LivenessPlan`), actions handed back,
cancelled, vanished or given up. Functions of the service's `Context`."""

from __future__ import annotations

import logging
from typing import Any

from scheduler.model import Allocation, ResourceKind
from scheduler.service import trajectories
from scheduler.service.context import Context
from scheduler.service.liveness import LivenessPlan
from scheduler.service.sandboxes import caller_trajectory
from tangram_celery.common.actions import ActionResult, ActionStatus

log = logging.getLogger("tangram.scheduler")


def apply(ctx: Context, plan: LivenessPlan, reports: dict[str, dict[str, Any]]) -> None:
    """Carry out one liveness pass (`liveness.assess`): forget silent workers, take pools
    offline (or back), release the sandboxes that are gone, then retry and re-route actions."""
    for w in plan.forget:
        ctx.store.forget_worker(w)
    set_offline(ctx, plan.offline)
    trajectories.reconcile(ctx, plan.alive, reports)
    running = ctx.state.running
    for action_id in plan.vanished:
        if action_id in running:
            forget_vanished(ctx, action_id)
    for action_id, worker, attempt in plan.reroute:
        if action_id in running:
            reroute(ctx, action_id, worker, attempt)
    for action_id, worker, attempt in plan.retry:
        if action_id in running:
            retry(ctx, action_id, worker, attempt)


def set_offline(ctx: Context, pools: set[str]) -> None:
    """Take CPU/GPU pools without live workers out of placement; bring returning ones back."""
    went, back, lost = ctx.state.set_offline(pools)
    for key in sorted(went):
        log.warning("pool %s has no live worker: offline", key)
    # Its trajectories start over elsewhere: otherwise their next actions would wait for the
    # node forever, and under FCFS everything behind them with them.
    for tid in lost:
        trajectories.release(ctx, tid, lost=True, remove=False)
    if lost:
        log.warning("%d trajectories pinned to offline nodes unpinned", len(lost))
    for key in sorted(back):
        log.info("pool %s is back", key)


def retry(ctx: Context, action_id: str, worker: str, attempt: int) -> None:
    """The worker running `action_id` died, or its message was lost before any worker claimed
    it (`worker` empty): send it again on the same pool as a new attempt, within a bound."""
    alloc = ctx.state.running[action_id]
    if attempt >= ctx.liveness.max_attempts:
        give_up(ctx, action_id, f"its worker was lost {attempt} time(s)")
        return
    if ctx.store.requeue(action_id, worker, "dispatched", attempt + 1, ctx.clock()):
        why = f"worker {worker} was lost" if worker else "it was never claimed"
        log.warning("action %s: %s; retrying (attempt %d)", action_id, why, attempt + 1)
        ctx.books.attempt[action_id] = attempt + 1
        ctx.metrics.retries.inc()
        ctx.sender.send([alloc], ctx.books)


def reroute(ctx: Context, action_id: str, worker: str, attempt: int) -> None:
    """The pool of `action_id` is gone: put it back at the front of the waiting queue."""
    if attempt >= ctx.liveness.max_attempts:
        give_up(ctx, action_id, f"its pool was lost {attempt} time(s)")
        return
    qa = ctx.books.running.get(action_id)
    if qa is None or not ctx.store.requeue(action_id, worker, "queued", attempt, ctx.clock()):
        return
    alloc = back_to_queue(ctx, action_id)
    log.warning("pool of %s is offline; re-routing (was on %s)", action_id, alloc and alloc.pool)
    ctx.metrics.reroutes.inc()
    if alloc is not None and alloc.kind is ResourceKind.CPU and qa.cost.sandbox:
        # its sandbox is gone with the node
        trajectories.release(ctx, qa.trajectory_id, lost=True, remove=False)


def retry_elsewhere(ctx: Context, action_id: str, error: str, unstarted: bool = False) -> None:
    """A worker handed `action_id` back after a retryable failure (its reward server crashed
    mid-batch, a replica failed to load): place it again, within the attempt bound. A rider
    handed back before it started (`unstarted`: an action ahead of it in its batch overran)
    did not fail: it is placed again whatever its attempt count, as an action that never rides
    again (`QueuedAction.solo`), so that it cannot come back a second time."""
    if action_id not in ctx.state.running:
        return  # already re-placed (an event replayed after a restart)
    attempt = ctx.books.attempt.get(action_id, 1)
    if not unstarted and attempt >= ctx.liveness.max_attempts:
        give_up(ctx, action_id, f"{attempt} attempt(s) failed, last: {error}")
        return
    alloc = back_to_queue(ctx, action_id, solo=unstarted)
    if unstarted:
        log.info("action %s handed back by %s (%s); placing it again", action_id, alloc and alloc.pool, error)
    else:
        log.warning("action %s failed on %s (%s); placing it again", action_id, alloc and alloc.pool, error)
        ctx.metrics.retries.inc()


def back_to_queue(ctx: Context, action_id: str, solo: bool = False) -> Allocation | None:
    """Release the units of a dispatched action and put it back in the waiting queue, in
    FCFS order (its Redis state is already 'queued'); with `solo`, it never rides again."""
    alloc = ctx.state.release(action_id)
    qa = ctx.books.requeued(action_id)
    if qa is not None:
        qa.solo = qa.solo or solo
        ctx.waiting.append(qa)
        ctx.waiting.sort_by_submission()
    return alloc


def forget_vanished(ctx: Context, action_id: str) -> None:
    """The action's record is gone from Redis (expired, or deleted by hand): free its units."""
    log.error("action %s has no record in Redis any more; releasing its units", action_id)
    ctx.state.release(action_id)
    qa = ctx.books.forget(action_id)
    ctx.store.forget_running([action_id])
    if qa is not None:
        trajectories.done(ctx, qa.trajectory_id)


def drop_cancelled(ctx: Context, action_id: str) -> None:
    """A caller cancelled `action_id` before it was dispatched (the store script made sure
    of that and removed its intake entry): forget it. Idempotent; an action the dispatch
    script already skipped is gone from the queue and is ignored here."""
    qa = ctx.waiting.get(action_id)
    if qa is None:
        return
    ctx.waiting.pop(action_id)
    ctx.books.entry_of.pop(action_id, None)
    ctx.books.meta.pop(action_id, None)
    trajectories.done(ctx, qa.trajectory_id)
    ctx.metrics.cancelled.inc()


def give_up(ctx: Context, action_id: str, why: str) -> None:
    """Finish a dispatched action as `error` (an infrastructure failure beyond the bound); its
    completion event releases it."""
    qa = ctx.books.running.get(action_id)
    tid = caller_trajectory(qa.trajectory_id) if qa else ""
    res = ActionResult(
        action_id=action_id,
        trajectory_id=tid,
        status=ActionStatus.ERROR,
        error=f"infrastructure failure: {why}",
        attempts=ctx.books.attempt.get(action_id, 0),
    )
    ctx.store.finish_unrun(action_id, res.model_dump_json(), tid)
