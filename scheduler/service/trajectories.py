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
action runs in a fresh sandbox and the result says so. `TrajectoryBook` owns what the scheduler
knows of them; the pins and reservations themselves are the `ClusterState`'s.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping

from scheduler.model import Allocation
from scheduler.resources import ClusterState
from scheduler.service.sandboxes import SandboxBook, is_one_shot
from scheduler.service.sender import Sender
from tangram_celery.common.metrics import SchedulerMetrics
from tangram_celery.common.records import PinRecord, SandboxReport
from tangram_celery.store import INTAKE, Store

log = logging.getLogger("tangram.scheduler")


class EvictionTally:
    """Idle trajectories evicted since the last summary in the log (kept across rebuilds)."""

    def __init__(self) -> None:
        self.count = 0
        self.logged_s = float("-inf")  # the first evictions are told at once

    def log(self, every_s: float = 30.0) -> None:
        """One line per `every_s` for the idle trajectories evicted meanwhile (one line per
        eviction, at DEBUG: a stateless caller evicts one per action)."""
        now = time.monotonic()
        if self.count and now - self.logged_s >= every_s:
            log.info(
                "evicted %d idle trajector%s to make room (memory is a cache; at most one such line per %.0f s)",
                self.count,
                "y" if self.count == 1 else "ies",
                every_s,
            )
            self.count = 0
            self.logged_s = now


class TrajectoryBook:
    """The trajectories' actions in flight, close requests, idle times and sandboxes (all
    rebuilt by recovery), and what ends their pins (see the module doc)."""

    def __init__(
        self,
        state: ClusterState,
        store: Store,
        sender: Sender,
        clock: Callable[[], float],
        metrics: SchedulerMetrics,
        idle_ttl_s: float,
        tally: EvictionTally | None = None,
    ) -> None:
        self.state, self.store, self.sender = state, store, sender
        self.clock, self.metrics, self.idle_ttl_s = clock, metrics, idle_ttl_s
        # trajectory -> its queued + running actions
        self.active: Counter[str] = Counter()
        # trajectory -> stream id of its close request (closed once nothing of it is active)
        self.closing: dict[str, str] = {}
        # pinned trajectory -> when one of its actions was last dispatched or completed (s)
        self.last_active: dict[str, float] = {}
        # sandbox generations, owners and pending resets of the pinned trajectories
        self.sandboxes = SandboxBook()
        self.tally = tally or EvictionTally()

    def pin_record(self, tid: str) -> PinRecord:
        """The persisted pin of `tid` (`tangram:traj`): node, reservation, generation, owner."""
        node = self.state.trajectory_node[tid]
        memory_mb = self.state.cpu[node].trajectory_memory_mb.get(tid, 0)
        return self.sandboxes.pin_record(tid, node, memory_mb)

    def request_close(self, tid: str, stream_id: str) -> None:
        self.closing[tid] = stream_id

    def evicted(self, alloc: Allocation, now_s: float) -> dict[str, str]:
        """Bookkeeping for the trajectories `alloc` evicted (already released by `apply`): they
        are reset, and their sandboxes must go. Returns trajectory -> generation, to close."""
        out: dict[str, str] = {}
        book = self.sandboxes
        for tid in alloc.evict:
            out[tid] = book.gen.get(tid, "")
            book.lost(tid, now_s)
            self.last_active.pop(tid, None)
        self.metrics.evictions.inc(len(alloc.evict))
        self.tally.count += len(alloc.evict)
        log.debug(
            "evicted %d idle trajector%s on %s for %s: %s",
            len(alloc.evict),
            "y" if len(alloc.evict) == 1 else "ies",
            alloc.pool,
            alloc.action_id,
            ", ".join(alloc.evict),
        )
        return out

    def release(self, tid: str, *, lost: bool, remove: bool = True, why: str | None = None) -> None:
        """Free the trajectory's memory and pin; `lost`: its caller may go on (mark it reset,
        its next result saying `why` when given); `remove`: have its node remove the sandbox
        (not when it is known to be gone)."""
        book = self.sandboxes
        node = self.state.trajectory_node.get(tid)
        gen = book.gen.get(tid, "")
        self.state.close_trajectory(tid)
        self.last_active.pop(tid, None)
        if is_one_shot(tid):
            book.closed(tid)
            return  # never persisted; its worker discards the sandbox itself
        if lost:
            book.lost(tid, self.clock(), why)
        else:
            book.closed(tid)
        resets = {tid: book.reset[tid]} if tid in book.reset else None
        self.store.update_pins({}, [tid], resets, [] if resets else [tid])
        if node is not None and remove:
            self.sender.close(node, tid, gen, keep=lost)

    def unpin_undone(self, tid: str, *, reset: bool) -> None:
        """The action that pinned `tid` was cancelled before it was sent: as if it never was (the
        pin and reservation go, and a reset it was to report is owed to the next action again)."""
        book = self.sandboxes
        self.state.close_trajectory(tid)
        book.closed(tid)
        if reset:
            book.note_reset(tid, self.clock())
        self.store.update_pins({}, [tid], {tid: book.reset[tid]} if reset else None)

    def done(self, tid: str) -> None:
        """One queued or running action of `tid` is over (completed, given up or vanished)."""
        self.last_active[tid] = self.clock()
        self.active[tid] -= 1
        if self.active[tid] <= 0:
            del self.active[tid]
            if is_one_shot(tid):
                self.release(tid, lost=False)

    def close_ready(self) -> None:
        """Close trajectories whose close was requested and that have nothing queued or running."""
        for tid in [t for t in self.closing if self.active.get(t, 0) == 0]:
            stream_id = self.closing.pop(tid)
            self.release(tid, lost=False)
            self.store.ack(INTAKE, [stream_id])

    def update(self, now_s: float) -> None:
        """The periodic pass: release trajectories idle past the sandbox TTL (the worker removes
        the sandbox itself after the same TTL; the close message makes sure), forget day-old
        resets, and tell the evictions made since the last summary."""
        for tid in list(self.state.trajectory_node):
            if self.active.get(tid, 0) == 0 and now_s - self.last_active.get(tid, now_s) > self.idle_ttl_s:
                self.release(tid, lost=True)
            elif tid not in self.last_active:
                self.last_active[tid] = now_s
        old = self.sandboxes.expire_resets(now_s)
        if old:
            self.store.update_pins({}, resets_done=old)
        self.tally.log()

    def reconcile(self, alive: set[str], reports: Mapping[str, SandboxReport]) -> None:
        """Release the idle trajectories whose sandbox no longer exists (see `SandboxBook.gone`):
        after a worker restart (or `tangram up` restarted over the same state) their reservations
        would otherwise hold the node's memory until the TTL."""
        offline_nodes = {k.partition(":")[2] for k in self.state.offline if k.startswith("cpu:")}
        idle = [
            t
            for t, node in self.state.trajectory_node.items()
            if self.active.get(t, 0) == 0 and node not in offline_nodes and not is_one_shot(t)
        ]
        if not idle:
            return
        lost, never = self.sandboxes.gone(idle, alive, reports)
        for tid in lost:
            self.release(tid, lost=True, remove=False)
        for tid in never:
            self.release(tid, lost=False, remove=False)
        if lost:
            self.metrics.sandboxes_lost.inc(len(lost))
            log.warning(
                "%d idle trajector%s lost their sandbox (worker restarted or gone): released, next "
                "actions reset: %s",
                len(lost),
                "y" if len(lost) == 1 else "ies",
                ", ".join(lost[:20]) + (" ..." if len(lost) > 20 else ""),
            )
        if never:
            log.info("%d pinned trajector(ies) never got a sandbox: released", len(never))
