"""Carrying out what went wrong: lost workers and pools (a `LivenessPlan`), actions handed back,
cancelled, vanished or given up. `Faults` owns nothing; it acts on the books that do."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from scheduler.model import Allocation, ResourceKind
from scheduler.resources import ClusterState
from scheduler.service.books import ActionBook
from scheduler.service.liveness import LivenessPlan, LivenessPolicy
from scheduler.service.sandboxes import caller_trajectory
from scheduler.service.sender import Sender
from scheduler.service.trajectories import TrajectoryBook
from tangram_celery.common.actions import ActionStatus
from tangram_celery.common.metrics import SchedulerMetrics
from tangram_celery.common.records import SandboxReport
from tangram_celery.common.wire import ActionResult
from tangram_celery.store import Store

log = logging.getLogger("tangram.scheduler")


class Faults:
    """Lost workers and pools, and actions handed back, cancelled, vanished or given up."""

    def __init__(
        self,
        state: ClusterState,
        books: ActionBook,
        trajectories: TrajectoryBook,
        store: Store,
        sender: Sender,
        policy: LivenessPolicy,
        clock: Callable[[], float],
        metrics: SchedulerMetrics,
    ) -> None:
        self.state, self.books, self.trajectories = state, books, trajectories
        self.store, self.sender, self.policy = store, sender, policy
        self.clock, self.metrics = clock, metrics
        self.left: set[str] = set()  # pools of nodes that drained and left (`nodes.NodeBook.gone`)

    def apply(self, plan: LivenessPlan, reports: Mapping[str, SandboxReport]) -> None:
        """Carry out one liveness pass (`liveness.assess`): forget silent workers, take pools
        offline (or back), release the sandboxes that are gone, then retry and re-route actions."""
        for w in plan.forget:
            self.store.forget_worker(w)
        self.set_offline(plan.offline)
        self.trajectories.reconcile(plan.alive, reports)
        running = self.state.running
        for action_id in plan.vanished:
            if action_id in running:
                self.forget_vanished(action_id)
        for action_id, worker, attempt in plan.reroute:
            if action_id in running:
                self.reroute(action_id, worker, attempt)
        for action_id, worker, attempt in plan.retry:
            if action_id in running:
                self.retry(action_id, worker, attempt)

    def set_offline(self, pools: set[str]) -> None:
        """Take CPU/GPU pools without live workers out of placement; bring returning ones back."""
        went, back, lost = self.state.set_offline(pools)
        for key in sorted(went):
            log.warning("pool %s has no live worker (or its node left): offline", key)
        # Its trajectories start over elsewhere: otherwise their next actions would wait for the
        # node forever, and under FCFS everything behind them with them.
        for tid in lost:
            why = self.left_why(self.state.trajectory_node.get(tid, ""))
            self.trajectories.release(tid, lost=True, remove=False, why=why)
        if lost:
            log.warning("%d trajectories pinned to offline nodes unpinned", len(lost))
        for key in sorted(back):
            log.info("pool %s is back", key)

    def left_why(self, node: str) -> str | None:
        """Why a trajectory pinned to CPU `node` lost its sandbox, when its node drained and left
        (`left`: pool keys of such nodes, kept up to date by the loop); None: it was lost."""
        return f"its node {node} was drained (its worker stopped)" if f"cpu:{node}" in self.left else None

    def drained(self, tids: list[str]) -> None:
        """Trajectories of draining nodes with no action running there: released, so that their
        next actions start over on another node, their results saying so (`sandbox_reset`, and
        why in `detail`). An image trajectory's kept layer stays on its node: it starts over
        from its image. The worker removes their sandboxes when it exits."""
        for tid in tids:
            node = self.state.trajectory_node.get(tid, "")
            cpu = self.state.cpu.get(node)
            why = f"its node {node} was drained (its worker stopped)"
            store = cpu.store if cpu is not None else None
            if store is not None and (tid in store.users or tid in store.layers):
                why += "; its image sandbox's files stayed on that node: it starts over from its image"
            self.trajectories.release(tid, lost=True, remove=False, why=why)
        if tids:
            log.info(
                "%d trajector%s released from draining nodes", len(tids), "y" if len(tids) == 1 else "ies"
            )

    def retry(self, action_id: str, worker: str, attempt: int) -> None:
        """The worker running `action_id` died, or its message was lost before any worker claimed
        it (`worker` empty): send it again on the same pool as a new attempt, within a bound."""
        alloc = self.state.running[action_id]
        if attempt >= self.policy.max_attempts:
            self.give_up(action_id, f"its worker was lost {attempt} time(s)")
            return
        if self.store.requeue(action_id, worker, "dispatched", attempt + 1, self.clock()):
            why = f"worker {worker} was lost" if worker else "it was never claimed"
            log.warning("action %s: %s; retrying (attempt %d)", action_id, why, attempt + 1)
            self.books.set_attempt(action_id, attempt + 1)
            self.metrics.retries.inc()
            self.sender.send([alloc], self.books)

    def reroute(self, action_id: str, worker: str, attempt: int) -> None:
        """The pool of `action_id` is gone: put it back at the front of the waiting queue."""
        if attempt >= self.policy.max_attempts:
            self.give_up(action_id, f"its pool was lost {attempt} time(s)")
            return
        qa = self.books.running(action_id)
        if qa is None or not self.store.requeue(action_id, worker, "queued", attempt, self.clock()):
            return
        alloc = self.back_to_queue(action_id)
        log.warning("pool of %s is offline; re-routing (was on %s)", action_id, alloc and alloc.pool)
        self.metrics.reroutes.inc()
        if alloc is not None and alloc.kind is ResourceKind.CPU and qa.cost.sandbox:
            # its sandbox is gone with the node
            why = self.left_why(alloc.pool)
            self.trajectories.release(qa.trajectory_id, lost=True, remove=False, why=why)

    def retry_elsewhere(self, action_id: str, error: str, unstarted: bool = False) -> None:
        """A worker handed `action_id` back after a retryable failure (its reward server crashed
        mid-batch, a replica failed to load): place it again, within the attempt bound. A rider
        handed back before it started (`unstarted`: an action ahead of it in its batch overran)
        did not fail: it is placed again whatever its attempt count, as an action that never rides
        again (`QueuedAction.solo`), so that it cannot come back a second time."""
        if action_id not in self.state.running:
            return  # already re-placed (an event replayed after a restart)
        attempt = self.books.attempt(action_id) or 1
        if not unstarted and attempt >= self.policy.max_attempts:
            self.give_up(action_id, f"{attempt} attempt(s) failed, last: {error}")
            return
        alloc = self.back_to_queue(action_id, solo=unstarted)
        if unstarted:
            log.info(
                "action %s handed back by %s (%s); placing it again", action_id, alloc and alloc.pool, error
            )
        else:
            log.warning(
                "action %s failed on %s (%s); placing it again", action_id, alloc and alloc.pool, error
            )
            self.metrics.retries.inc()

    def back_to_queue(self, action_id: str, solo: bool = False) -> Allocation | None:
        """Release the units of a dispatched action and put it back in the waiting queue, in
        FCFS order (its Redis state is already 'queued'); with `solo`, it never rides again."""
        alloc = self.state.release(action_id)
        self.books.requeue(action_id, solo)
        return alloc

    def forget_vanished(self, action_id: str) -> None:
        """The action's record is gone from Redis (expired, or deleted by hand): free its units."""
        log.error("action %s has no record in Redis any more; releasing its units", action_id)
        self.state.release(action_id)
        qa = self.books.forget(action_id)
        self.store.forget_running([action_id])
        if qa is not None:
            self.trajectories.done(qa.trajectory_id)

    def drop_cancelled(self, action_id: str) -> None:
        """A caller cancelled `action_id` before it was dispatched (the store script made sure
        of that and removed its intake entry): forget it. Idempotent; an action the dispatch
        script already skipped is gone from the queue and is ignored here."""
        qa = self.books.cancel(action_id)
        if qa is None:
            return
        self.trajectories.done(qa.trajectory_id)
        self.metrics.cancelled.inc()

    def give_up(self, action_id: str, why: str) -> None:
        """Finish a dispatched action as `error` (an infrastructure failure beyond the bound); its
        completion event releases it."""
        qa = self.books.running(action_id)
        tid = caller_trajectory(qa.trajectory_id) if qa else ""
        res = ActionResult(
            action_id=action_id,
            trajectory_id=tid,
            status=ActionStatus.ERROR,
            error=f"infrastructure failure: {why}",
            attempts=self.books.attempt(action_id),
        )
        self.store.finish_unrun(action_id, res.model_dump_json(), tid)
