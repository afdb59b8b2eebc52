"""Carrying out a round's plan: apply it to the state, persist it, send the Celery messages.

Crash safety: an intake entry is acknowledged only in the same script that persists its
dispatch record (`Store.mark_dispatched`), and messages are sent after that. A scheduler that
dies in between re-sends every action still `dispatched` when it restarts; workers claim
actions with a compare-and-set, so a re-sent message never runs an action twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies.malleable import idle_while_malleable
from scheduler.policies.time_share import oversubscribed
from scheduler.resources import ClusterState
from scheduler.round import Round, RoundPlan
from scheduler.service.books import ActionBook
from scheduler.service.cluster import alloc_to_wire
from scheduler.service.record import RunRecorder
from scheduler.service.sandboxes import is_one_shot
from scheduler.service.sender import Sender
from scheduler.service.tenants import TenantBook
from scheduler.service.trajectories import TrajectoryBook
from scheduler.service.warmer import GpuWarmer, predict_host
from tangram_celery.common.records import PinRecord
from tangram_celery.common.wire import DispatchRecord, SandboxOrder
from tangram_celery.store import Store

log = logging.getLogger("tangram.scheduler")


@dataclass
class _Outcome:
    """What applying a round's started actions leaves to persist and send."""

    records: list[DispatchRecord] = field(default_factory=list)
    pins: dict[str, PinRecord] = field(default_factory=dict)  # new pins, or larger reservations
    to_close: list[tuple[str, str, str]] = field(default_factory=list)  # (node, trajectory, gen) evicted
    resets_done: list[str] = field(default_factory=list)  # resets the started actions report


class Dispatcher:
    """Runs the round over the waiting queue and carries its plan out (see the module doc)."""

    def __init__(
        self,
        state: ClusterState,
        books: ActionBook,
        trajectories: TrajectoryBook,
        warmer: GpuWarmer,
        sender: Sender,
        store: Store,
        recorder: RunRecorder,
        clock: Callable[[], float],
        check_invariants: bool = False,
    ) -> None:
        self.state, self.books, self.trajectories, self.warmer = state, books, trajectories, warmer
        self.sender, self.store, self.recorder, self.clock = sender, store, recorder, clock
        self.check_invariants = check_invariants
        # quotas per tenant (issue 37), synced with the registry by the loop (`sync_tenants`)
        self.tenants = TenantBook(store, recorder.metrics)
        self.dispatched_total = 0
        self.progress_s = time.monotonic()  # when actions were last dispatched

    def schedule(self, rnd: Round) -> int:
        """One round over the waiting queue; returns how many actions were dispatched. With
        nothing waiting, the round's idle steps (loans, warm placements)."""
        now = self.clock()
        waiting = self.books.waiting
        if not waiting:
            self._idle(rnd, now)
            self._check(rnd)
            return 0
        self.warmer.retire(rnd, now)
        plan = rnd.plan(waiting, self.state, now)
        self.recorder.metrics.decision.observe(plan.decision_s)
        if not plan.started:
            self._carry_out(plan, now)
            self._check(rnd)
            return 0
        out = self._apply(plan, now)
        skipped = self._persist(plan, out, now)
        self._carry_out(plan, now)  # take-backs reach the workers before the actions
        self._check(rnd)
        started = self._undo_skipped(plan.started, skipped)
        share = rnd.execution.time_share
        self.sender.send(  # evicted whether or not their evicter was cancelled
            started, self.books, closes=out.to_close, share_weight=share.weight if share is not None else None
        )
        self.recorder.dispatched(started)
        self.dispatched_total += len(started)
        self.progress_s = time.monotonic()
        return len(started)

    def _idle(self, rnd: Round, now_s: float) -> None:
        """The round's steps that need no waiting action, carried out (`Round.idle`)."""
        ex = rnd.execution
        if not ex.lend_cores and not (ex.warm_gpu and self.state.gpu):
            return
        self.warmer.retire(rnd, now_s)
        self._carry_out(rnd.idle(self.books.waiting, self.state, now_s), now_s)

    def _carry_out(self, plan: RoundPlan, now_s: float) -> None:
        """Send the round's changed loans and warm restores (after its allocations are applied)."""
        self.sender.lend(plan.lends)
        for load in plan.warm:
            self.warmer.warm(load, now_s)
        for f in plan.fetches:  # on their way: the next rounds count on them, and resend none
            store = self.state.cpu[f.node].store if f.node in self.state.cpu else None
            if store is not None:
                store.fetch(f.image, f.size_mb, now_s, f.evict)
        self.sender.fetch(plan.fetches)

    def _apply(self, plan: RoundPlan, now_s: float) -> _Outcome:
        """Apply the started actions to the state, in the plan's order, and note each one as
        dispatched (its next attempt, its sandbox order, its dispatch record)."""
        out = _Outcome()
        riders = {a.action_id for a in plan.riders}
        leads = {(a.pool, a.unit_ids) for a in plan.allocs}
        for alloc in plan.started:
            qa = self.books.waiting.action(alloc.action_id)
            sandbox = self._apply_one(plan, alloc, qa, alloc.action_id in riders, leads, now_s, out)
            t = self.books.dispatched(qa, sandbox)
            out.records.append(
                DispatchRecord(alloc=alloc_to_wire(alloc), meta=t.meta, attempt=t.attempt, sandbox=sandbox)
            )
        return out

    def _apply_one(
        self,
        plan: RoundPlan,
        alloc: Allocation,
        qa: QueuedAction,
        rider: bool,
        leads: set[tuple[str, tuple[int, ...]]],
        now_s: float,
        out: _Outcome,
    ) -> SandboxOrder | None:
        """Apply one started action; returns its sandbox order (a sandboxed CPU action of a
        trajectory), and notes in `out` the pins, evictions and resets it makes."""
        state, metrics = self.state, self.recorder.metrics
        tid = qa.trajectory_id
        fresh = tid not in state.trajectory_node
        sandboxed = alloc.kind is ResourceKind.CPU and qa.cost.sandbox
        held = 0 if fresh or not sandboxed else state.cpu[alloc.pool].trajectory_memory_mb.get(tid, 0)
        if alloc.shares:  # last: time-shares cores held by a running action
            state.share_cores(alloc, qa, now_s)
            metrics.time_shares.labels(pool=f"cpu:{alloc.pool}").inc()
        elif rider:  # after every allocation (a GPU rider joins its batch's chunk, a CPU one queues
            # on its cores, behind this round's allocation or a batch already running there)
            state.share(alloc, qa, now_s)
            if alloc.kind is ResourceKind.CPU and (alloc.pool, alloc.unit_ids) not in leads:
                metrics.batch_joins.labels(pool=f"cpu:{alloc.pool}").inc()
        else:
            state.apply(alloc, qa, now_s)
        load = plan.gpu_loads.get(alloc.action_id)
        if load is not None:
            state.load_gpu(load, now_s)  # predicted until the node reports what it holds
            predict_host(state, load.pool, load.victims, (load.chunk, load.service))
        if alloc.evict:
            gens = self.trajectories.evicted(alloc, now_s)
            out.to_close += [(alloc.pool, t, g) for t, g in gens.items()]
        if not sandboxed or is_one_shot(tid):
            return None
        book = self.trajectories.sandboxes
        if fresh:
            sandbox = book.pinned(tid, alloc.action_id)
            if sandbox.reset:
                out.resets_done.append(tid)
        else:
            sandbox = book.reuse(tid, alloc.action_id)
        if fresh or state.cpu[alloc.pool].trajectory_memory_mb.get(tid, 0) != held:
            out.pins[tid] = self.trajectories.pin_record(tid)  # new, or a larger reservation
        return sandbox

    def _persist(self, plan: RoundPlan, out: _Outcome, now_s: float) -> set[str]:
        """Persist the dispatch records, pins and resets, acknowledge the intake entries, and
        take the started actions off the queue; returns the ones the store skipped (cancelled
        after the policy chose them)."""
        books, started = self.books, plan.started
        entries = [e for e in (books.take_entry(a.action_id) for a in started) if e is not None]
        evicted = [t for _, t, _ in out.to_close]
        reset = self.trajectories.sandboxes.reset
        resets = {t: reset[t] for t in evicted if t in reset}
        skipped = set(
            self.store.mark_dispatched(
                out.records,
                out.pins,
                entries,
                now_s,
                forget_pins=evicted,
                resets=resets,
                resets_done=out.resets_done,
            )
        )
        for a in started:
            books.waiting.pop(a.action_id)
        return skipped

    def _undo_skipped(self, started: list[Allocation], skipped: set[str]) -> list[Allocation]:
        """Undo the started actions the store skipped (cancelled meanwhile): send them nothing."""
        if not skipped:
            return started
        for action_id in skipped:
            self.undo(action_id)
        return [a for a in started if a.action_id not in skipped]

    def _check(self, rnd: Round) -> None:
        """Debug mode (`scheduler.check_invariants`): the round's core loans conserve work (no core
        idles on a node while a malleable action running there could use it), and time sharing
        keeps its bounds (`time_share.oversubscribed`)."""
        if not self.check_invariants:
            return
        bad = idle_while_malleable(rnd.borrowers(), rnd.lent, self.state) if rnd.execution.lend_cores else []
        share = rnd.execution.time_share
        if share is not None:
            bad += oversubscribed(self.state, share)
        if bad:
            raise AssertionError(f"work conservation and sharing bounds: {bad}")

    def undo(self, action_id: str) -> None:
        """The store refused to dispatch `action_id` (cancelled meanwhile): give its units back,
        and the pin it made, if it pinned its trajectory and nothing else of it runs."""
        self.state.release(action_id)
        t = self.books.get(action_id)
        info = t.sandbox if t is not None else None
        qa = self.books.forget(action_id)
        if qa is not None:
            tid = qa.trajectory_id
            if info is not None and info.new and not self.state.trajectory_running.get(tid):
                self.trajectories.unpin_undone(tid, reset=info.reset)
            self.trajectories.done(tid)
        self.recorder.metrics.cancelled.inc()
        log.info("action %s was cancelled before dispatch; not sent", action_id)
