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
action runs in a fresh sandbox and the result says so. These functions act on a
`SchedulerService` (its state, store and Celery app), as `liveness` and `recovery` do.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from scheduler.model import Allocation
from scheduler.service.sandboxes import Report, is_one_shot
from tangram_celery.app import TASK_CLOSE, queue_name
from tangram_celery.store import INTAKE

if TYPE_CHECKING:
    from scheduler.service.loop import SchedulerService

log = logging.getLogger("tangram.scheduler")


def pin_record(svc: SchedulerService, tid: str) -> dict[str, Any]:
    """The persisted pin of `tid` (`tangram:traj`): node, reservation, generation, owner."""
    node = svc.state.trajectory_node[tid]
    memory_mb = svc.state.cpu[node].trajectory_memory_mb.get(tid, 0)
    return {"node": node, "memory_mb": memory_mb, **svc.book.pin_fields(tid)}


def evicted(svc: SchedulerService, alloc: Allocation, now_s: float) -> dict[str, str]:
    """Bookkeeping for the trajectories `alloc` evicted (already released by `apply`): they are
    reset, and their sandboxes must go. Returns trajectory -> generation, to close on the node."""
    out: dict[str, str] = {}
    for tid in alloc.evict:
        out[tid] = svc.book.gen.get(tid, "")
        svc.book.lost(tid, now_s)
        svc.last_active.pop(tid, None)
    svc.metrics.evictions.inc(len(alloc.evict))
    log.info(
        "evicted %d idle trajector%s on %s for %s: %s",
        len(alloc.evict),
        "y" if len(alloc.evict) == 1 else "ies",
        alloc.pool,
        alloc.action_id,
        ", ".join(alloc.evict),
    )
    return out


def send_close(svc: SchedulerService, node: str, tid: str, gen: str) -> None:
    """Have the worker of `node` remove `tid`'s sandbox of generation `gen` (only that one: a
    newer sandbox of the same trajectory, started since, is kept)."""
    svc.app.send_task(TASK_CLOSE, args=[tid, gen], queue=queue_name("cpu", node))


def release(svc: SchedulerService, tid: str, *, lost: bool, remove: bool = True) -> None:
    """Free the trajectory's memory and pin; `lost`: its caller may go on (mark it reset);
    `remove`: have its node remove the sandbox (not when it is known to be gone)."""
    node = svc.state.trajectory_node.get(tid)
    gen = svc.book.gen.get(tid, "")
    svc.state.close_trajectory(tid)
    svc.last_active.pop(tid, None)
    if is_one_shot(tid):
        svc.book.closed(tid)
        return  # never persisted; its worker discards the sandbox itself
    if lost:
        svc.book.lost(tid, svc.clock())
    else:
        svc.book.closed(tid)
    resets = {tid: svc.book.reset[tid]} if tid in svc.book.reset else None
    svc.store.update_pins({}, [tid], resets, [] if resets else [tid])
    if node is not None and remove:
        send_close(svc, node, tid, gen)


def unpin_undone(svc: SchedulerService, tid: str, *, reset: bool) -> None:
    """The action that pinned `tid` was cancelled before it was sent: as if it never was (the
    pin and reservation go, and a reset it was to report is owed to the next action again)."""
    svc.state.close_trajectory(tid)
    svc.book.closed(tid)
    if reset:
        svc.book.reset[tid] = svc.clock()
    svc.store.update_pins({}, [tid], {tid: svc.book.reset[tid]} if reset else None)


def done(svc: SchedulerService, tid: str) -> None:
    """One queued or running action of `tid` is over (completed, given up or vanished)."""
    svc.last_active[tid] = svc.clock()
    svc.active[tid] -= 1
    if svc.active[tid] <= 0:
        del svc.active[tid]
        if is_one_shot(tid):
            release(svc, tid, lost=False)


def close_ready(svc: SchedulerService) -> None:
    """Close trajectories whose close was requested and that have nothing queued or running."""
    for tid in [t for t in svc.closing if svc.active.get(t, 0) == 0]:
        stream_id = svc.closing.pop(tid)
        release(svc, tid, lost=False)
        svc.store.ack(INTAKE, [stream_id])


def expire_idle(svc: SchedulerService, now_s: float) -> None:
    """Release trajectories idle past the sandbox TTL (the worker removes the sandbox itself
    after the same TTL; the close message makes sure), and forget day-old resets."""
    ttl_s = svc.cfg.sandbox.idle_ttl_s
    for tid in list(svc.state.trajectory_node):
        if svc.active.get(tid, 0) == 0 and now_s - svc.last_active.get(tid, now_s) > ttl_s:
            release(svc, tid, lost=True)
        elif tid not in svc.last_active:
            svc.last_active[tid] = now_s
    old = svc.book.expire_resets(now_s)
    if old:
        svc.store.update_pins({}, resets_done=old)


def reconcile(svc: SchedulerService, alive: set[str], reports: dict[str, dict[str, Any]]) -> None:
    """Release the idle trajectories whose sandbox no longer exists (see `SandboxBook.gone`):
    after a worker restart (or `tangram up` restarted over the same state) their reservations
    would otherwise hold the node's memory until the TTL."""
    offline_nodes = {k.partition(":")[2] for k in svc.offline if k.startswith("cpu:")}
    idle = [
        t
        for t, node in svc.state.trajectory_node.items()
        if svc.active.get(t, 0) == 0 and node not in offline_nodes and not is_one_shot(t)
    ]
    if not idle:
        return
    parsed = {w: Report.from_dict(r) for w, r in reports.items()}
    lost, never = svc.book.gone(idle, alive, parsed)
    for tid in lost:
        release(svc, tid, lost=True, remove=False)
    for tid in never:
        release(svc, tid, lost=False, remove=False)
    if lost:
        svc.metrics.sandboxes_lost.inc(len(lost))
        log.warning(
            "%d idle trajector%s lost their sandbox (worker restarted or gone): released, next "
            "actions reset: %s",
            len(lost),
            "y" if len(lost) == 1 else "ies",
            ", ".join(lost[:20]) + (" ..." if len(lost) > 20 else ""),
        )
    if never:
        log.info("%d pinned trajector(ies) never got a sandbox: released", len(never))
