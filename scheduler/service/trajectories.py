"""The scheduler's side of trajectory lifecycles: pins, reservations and sandboxes over time.

A trajectory is pinned to a CPU node by its first sandboxed action and holds a memory
reservation there while its sandbox lives. The sandbox (and so the pin and reservation) ends:
- when the caller closes the trajectory (once nothing of it is queued or running);
- when the policy evicts it, idle, to make room (memory is a cache: `scheduler.eviction`);
- after `sandbox.idle_ttl_s` without actions (an upper bound);
- when it is gone: its node went offline, its worker died or restarted, or the worker no
  longer lists it (`SandboxBook.gone`);
- right after its only action, for a one-shot action.
In every case but a close (and a one-shot action), the trajectory is marked reset: its next
action runs in a fresh sandbox and the result says so. These functions act on the service's
`Context` (its state, books, store and Celery sender).
"""

from __future__ import annotations

import logging
from typing import Any

from scheduler.model import Allocation
from scheduler.service.context import Context
from scheduler.service.sandboxes import Report, is_one_shot
from tangram_celery.store import INTAKE

log = logging.getLogger("tangram.scheduler")


def pin_record(ctx: Context, tid: str) -> dict[str, Any]:
    """The persisted pin of `tid` (`tangram:traj`): node, reservation, generation, owner."""
    node = ctx.state.trajectory_node[tid]
    memory_mb = ctx.state.cpu[node].trajectory_memory_mb.get(tid, 0)
    return {"node": node, "memory_mb": memory_mb, **ctx.books.sandboxes.pin_fields(tid)}


def evicted(ctx: Context, alloc: Allocation, now_s: float) -> dict[str, str]:
    """Bookkeeping for the trajectories `alloc` evicted (already released by `apply`): they are
    reset, and their sandboxes must go. Returns trajectory -> generation, to close on the node."""
    out: dict[str, str] = {}
    book = ctx.books.sandboxes
    for tid in alloc.evict:
        out[tid] = book.gen.get(tid, "")
        book.lost(tid, now_s)
        ctx.books.last_active.pop(tid, None)
    ctx.metrics.evictions.inc(len(alloc.evict))
    ctx.evicted_since_log += len(alloc.evict)
    log.debug(
        "evicted %d idle trajector%s on %s for %s: %s",
        len(alloc.evict),
        "y" if len(alloc.evict) == 1 else "ies",
        alloc.pool,
        alloc.action_id,
        ", ".join(alloc.evict),
    )
    return out


def release(ctx: Context, tid: str, *, lost: bool, remove: bool = True) -> None:
    """Free the trajectory's memory and pin; `lost`: its caller may go on (mark it reset);
    `remove`: have its node remove the sandbox (not when it is known to be gone)."""
    book = ctx.books.sandboxes
    node = ctx.state.trajectory_node.get(tid)
    gen = book.gen.get(tid, "")
    ctx.state.close_trajectory(tid)
    ctx.books.last_active.pop(tid, None)
    if is_one_shot(tid):
        book.closed(tid)
        return  # never persisted; its worker discards the sandbox itself
    if lost:
        book.lost(tid, ctx.clock())
    else:
        book.closed(tid)
    resets = {tid: book.reset[tid]} if tid in book.reset else None
    ctx.store.update_pins({}, [tid], resets, [] if resets else [tid])
    if node is not None and remove:
        ctx.sender.close(node, tid, gen)


def unpin_undone(ctx: Context, tid: str, *, reset: bool) -> None:
    """The action that pinned `tid` was cancelled before it was sent: as if it never was (the
    pin and reservation go, and a reset it was to report is owed to the next action again)."""
    book = ctx.books.sandboxes
    ctx.state.close_trajectory(tid)
    book.closed(tid)
    if reset:
        book.note_reset(tid, ctx.clock())
    ctx.store.update_pins({}, [tid], {tid: book.reset[tid]} if reset else None)


def done(ctx: Context, tid: str) -> None:
    """One queued or running action of `tid` is over (completed, given up or vanished)."""
    books = ctx.books
    books.last_active[tid] = ctx.clock()
    books.active[tid] -= 1
    if books.active[tid] <= 0:
        del books.active[tid]
        if is_one_shot(tid):
            release(ctx, tid, lost=False)


def close_ready(ctx: Context) -> None:
    """Close trajectories whose close was requested and that have nothing queued or running."""
    books = ctx.books
    for tid in [t for t in books.closing if books.active.get(t, 0) == 0]:
        stream_id = books.closing.pop(tid)
        release(ctx, tid, lost=False)
        ctx.store.ack(INTAKE, [stream_id])


def expire_idle(ctx: Context, now_s: float) -> None:
    """Release trajectories idle past the sandbox TTL (the worker removes the sandbox itself
    after the same TTL; the close message makes sure), and forget day-old resets."""
    books = ctx.books
    ttl_s = ctx.cfg.sandbox.idle_ttl_s
    for tid in list(ctx.state.trajectory_node):
        if books.active.get(tid, 0) == 0 and now_s - books.last_active.get(tid, now_s) > ttl_s:
            release(ctx, tid, lost=True)
        elif tid not in books.last_active:
            books.last_active[tid] = now_s
    old = books.sandboxes.expire_resets(now_s)
    if old:
        ctx.store.update_pins({}, resets_done=old)


def reconcile(ctx: Context, alive: set[str], reports: dict[str, dict[str, Any]]) -> None:
    """Release the idle trajectories whose sandbox no longer exists (see `SandboxBook.gone`):
    after a worker restart (or `tangram up` restarted over the same state) their reservations
    would otherwise hold the node's memory until the TTL."""
    offline_nodes = {k.partition(":")[2] for k in ctx.state.offline if k.startswith("cpu:")}
    active = ctx.books.active
    idle = [
        t
        for t, node in ctx.state.trajectory_node.items()
        if active.get(t, 0) == 0 and node not in offline_nodes and not is_one_shot(t)
    ]
    if not idle:
        return
    parsed = {w: Report.from_dict(r) for w, r in reports.items()}
    lost, never = ctx.books.sandboxes.gone(idle, alive, parsed)
    for tid in lost:
        release(ctx, tid, lost=True, remove=False)
    for tid in never:
        release(ctx, tid, lost=False, remove=False)
    if lost:
        ctx.metrics.sandboxes_lost.inc(len(lost))
        log.warning(
            "%d idle trajector%s lost their sandbox (worker restarted or gone): released, next "
            "actions reset: %s",
            len(lost),
            "y" if len(lost) == 1 else "ies",
            ", ".join(lost[:20]) + (" ..." if len(lost) > 20 else ""),
        )
    if never:
        log.info("%d pinned trajector(ies) never got a sandbox: released", len(never))
