"""Carrying out a round's plan: apply it to the state, persist it, send the Celery messages.

Crash safety: an intake entry is acknowledged only in the same script that persists its
dispatch record (`Store.mark_dispatched`), and messages are sent after that. A scheduler that
dies in between re-sends every action still `dispatched` when it restarts; workers claim
actions with a compare-and-set, so a re-sent message never runs an action twice.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies.malleable import idle_while_malleable
from scheduler.policies.time_share import oversubscribed
from scheduler.round import Round
from scheduler.service import elastic, trajectories
from scheduler.service.cluster import alloc_to_wire
from scheduler.service.context import Context
from scheduler.service.sandboxes import is_one_shot
from tangram_celery.common.wire import DispatchRecord, SandboxOrder

log = logging.getLogger("tangram.scheduler")


def schedule(ctx: Context, rnd: Round) -> int:
    """One round over the waiting queue; returns how many actions were dispatched. With nothing
    waiting, the round's idle steps (loans, warm placements: `elastic.idle`)."""
    now = ctx.clock()
    if not ctx.waiting:
        elastic.idle(ctx, rnd, now)
        _check(ctx, rnd)
        return 0
    elastic.retire(ctx, rnd, now)
    plan = rnd.plan(ctx.waiting, ctx.state, now)
    ctx.metrics.decision.observe(plan.decision_s)
    if not plan.started:
        elastic.carry_out(ctx, plan, now)
        _check(ctx, rnd)
        return 0
    state, books = ctx.state, ctx.books
    by_id = {a.action_id: ctx.waiting.action(a.action_id) for a in plan.started}
    pins: dict[str, dict[str, Any]] = {}
    records: list[DispatchRecord] = []
    to_close: list[tuple[str, str, str]] = []  # (node, trajectory, generation) evicted
    resets_done: list[str] = []
    riders = {a.action_id for a in plan.riders}
    leads = {(a.pool, a.unit_ids) for a in plan.allocs}
    for alloc in plan.started:
        qa = by_id[alloc.action_id]
        rider = alloc.action_id in riders
        tid = qa.trajectory_id
        fresh = tid not in state.trajectory_node
        sandboxed = alloc.kind is ResourceKind.CPU and qa.cost.sandbox
        held = 0 if fresh or not sandboxed else state.cpu[alloc.pool].trajectory_memory_mb.get(tid, 0)
        if alloc.shares:  # last: time-shares cores held by a running action
            state.share_cores(alloc, qa, now)
            ctx.metrics.time_shares.labels(pool=f"cpu:{alloc.pool}").inc()
        elif rider:  # after every allocation (a GPU rider joins its batch's chunk, a CPU one queues on its
            # cores, behind this round's allocation or a batch already running there)
            state.share(alloc, qa, now)
            if alloc.kind is ResourceKind.CPU and (alloc.pool, alloc.unit_ids) not in leads:
                ctx.metrics.batch_joins.labels(pool=f"cpu:{alloc.pool}").inc()
        else:
            state.apply(alloc, qa, now)
        load = plan.gpu_loads.get(alloc.action_id)
        if load is not None:
            state.load_gpu(load, now)  # predicted until the node reports what it holds
        if alloc.evict:
            gens = trajectories.evicted(ctx, alloc, now)
            to_close += [(alloc.pool, t, g) for t, g in gens.items()]
        sandbox: SandboxOrder | None = None
        if sandboxed and not is_one_shot(tid):
            if fresh:
                sandbox = books.sandboxes.pinned(tid, alloc.action_id)
                if sandbox.reset:
                    resets_done.append(tid)
            else:
                sandbox = books.sandboxes.reuse(tid, alloc.action_id)
            if fresh or state.cpu[alloc.pool].trajectory_memory_mb.get(tid, 0) != held:
                pins[tid] = trajectories.pin_record(ctx, tid)  # new, or a larger reservation
        records.append(_record(ctx, alloc, qa, sandbox))
    started = plan.started
    entries = [e for e in (books.entry_of.pop(a.action_id, None) for a in started) if e is not None]
    evicted = [t for _, t, _ in to_close]
    resets = {t: books.sandboxes.reset[t] for t in evicted if t in books.sandboxes.reset}
    skipped = set(
        ctx.store.mark_dispatched(
            records, pins, entries, now, forget_pins=evicted, resets=resets, resets_done=resets_done
        )
    )
    for a in started:
        ctx.waiting.pop(a.action_id)
    elastic.carry_out(ctx, plan, now)  # take-backs reach the workers before the actions
    _check(ctx, rnd)
    if skipped:  # cancelled after the policy chose them: undo, send nothing
        for action_id in skipped:
            undo(ctx, action_id)
        started = [a for a in started if a.action_id not in skipped]
    share = rnd.execution.time_share
    ctx.sender.send(  # evicted whether or not their evicter was cancelled
        started, books, closes=to_close, share_weight=share.weight if share is not None else None
    )
    ctx.recorder.dispatched(started)
    ctx.dispatched_total += len(started)
    ctx.progress_s = time.monotonic()
    return len(started)


def _check(ctx: Context, rnd: Round) -> None:
    """Debug mode (`scheduler.check_invariants`): the round's core loans conserve work (no core
    idles on a node while a malleable action running there could use it), and time sharing
    keeps its bounds (`time_share.oversubscribed`)."""
    if not ctx.cfg.scheduler.check_invariants:
        return
    bad = idle_while_malleable(rnd.borrowers(), rnd.lent, ctx.state) if rnd.execution.lend_cores else []
    share = rnd.execution.time_share
    if share is not None:
        bad += oversubscribed(ctx.state, share)
    if bad:
        raise AssertionError(f"work conservation and sharing bounds: {bad}")


def _record(
    ctx: Context, alloc: Allocation, qa: QueuedAction, sandbox: SandboxOrder | None
) -> DispatchRecord:
    """Note `qa` as dispatched (its next attempt) and make its dispatch record."""
    attempt = ctx.books.dispatched(qa, sandbox)
    meta = ctx.books.meta[qa.action_id]
    return DispatchRecord(alloc=alloc_to_wire(alloc), meta=meta, attempt=attempt, sandbox=sandbox)


def undo(ctx: Context, action_id: str) -> None:
    """The store refused to dispatch `action_id` (cancelled meanwhile): give its units back,
    and the pin it made, if it pinned its trajectory and nothing else of it runs."""
    ctx.state.release(action_id)
    info = ctx.books.sandbox_of.get(action_id)
    qa = ctx.books.forget(action_id)
    if qa is not None:
        tid = qa.trajectory_id
        if info is not None and info.new and not ctx.state.trajectory_running.get(tid):
            trajectories.unpin_undone(ctx, tid, reset=info.reset)
        trajectories.done(ctx, tid)
    ctx.metrics.cancelled.inc()
    log.info("action %s was cancelled before dispatch; not sent", action_id)
