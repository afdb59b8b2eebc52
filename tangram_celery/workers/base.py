"""What every worker does around its resource-specific handler.

claim (dispatched -> running, exactly once; a `Claim` carries the action's metadata and
payload) -> run the handler -> build the result with its timings (`run_result`) and its event
(`Completion.of`) -> store the result, wake the client and emit the release event (one Lua
script). A handler returns the `ActionResult` of the user's outcome; infrastructure exceptions
become status `error` after the handler's own retries.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from celery import Celery

from tangram_celery.common.actions import ActionStatus
from tangram_celery.common.metrics import WorkerMetrics
from tangram_celery.common.wire import ActionMeta, ActionResult, Completion, EventStatus, TaskOrder, residency
from tangram_celery.store import Store
from tangram_celery.store.worker_side import Claim, Refused
from tangram_celery.workers.turns import CoreTurns, turn_key

log = logging.getLogger("tangram.worker")

Handler = Callable[[str, dict[str, Any], TaskOrder], ActionResult]
"""handler(action_id, payload, order) -> ActionResult of the user's outcome (`run_result` adds
what the worker knows: timings, placement, attempt). The payload is the action as its client
stored it (`actions.stored_action` types it without checking it again). A GPU handler also has
`residency()` and `host_residency()`: what its node holds on its devices and in host memory
only, sent with each completion."""


def run_result(
    result: ActionResult, meta: ActionMeta, order: TaskOrder, started_s: float, finished_s: float
) -> ActionResult:
    """The result a client reads: a handler's `result` with its trajectory, its timings (epoch
    seconds: submitted, started and finished), its placement and the attempt it ran as."""
    return result.model_copy(
        update={
            "trajectory_id": meta.trajectory_id,
            "queue_s": max(0.0, started_s - meta.submitted_s),
            "exec_s": result.exec_s or finished_s - started_s,  # the handler's, when it timed it
            "act_s": max(0.0, finished_s - meta.submitted_s),
            "units": order.units,
            "node": order.pool,
            "attempts": order.attempt,
            "batch_size": result.batch_size or order.batch,
        }
    )


class WorkerRuntime:
    """Per-process worker state: the store connection and the worker's name."""

    def __init__(self, broker_url: str, kind: str, pool: str, heartbeat_s: float = 1.0) -> None:
        self.store = Store(broker_url)
        # Unique per incarnation: a restarted worker must not inherit its predecessor's actions
        # or sandboxes (a pid alone repeats, e.g. as PID 1 of a restarted container).
        self.name = f"{kind}-{pool}@{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.pool_key = f"{kind}:{pool}"
        self.heartbeat_s = heartbeat_s
        self.app: Celery | None = None
        self.metrics = WorkerMetrics()
        # Completions counted, and (CPU workers) the sandboxes held: reported next to the
        # heartbeat so the scheduler can tell which trajectories lost theirs (a report taken
        # after a completion that does not list the trajectory; none at all after a restart).
        self.seq = 0
        self._seq_lock = threading.Lock()
        self.held: Callable[[], list[tuple[str, str]]] | None = None
        self.images: Callable[[], dict[str, Any] | None] | None = None  # a CPU node's image report
        self.languages: list[str] | None = None  # (CPU workers) what the node's sandboxes run
        self._images_reported: dict[str, Any] | None = None
        # (CPU workers) removes a trajectory's sandbox of a generation: closes an order carries
        self.closer: Callable[[str, str], None] | None = None
        # a CPU batch running this long hands its riders not yet started back (0: never)
        self.batch_hand_back_s = 2.0
        # (CPU workers) actions sent for the same cores run one after another (a batch sent
        # behind one that still runs there waits for it)
        self.turns = CoreTurns()
        self._reported: tuple[int, list[tuple[str, str]]] | None = None
        self._reported_at = 0.0
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeats, name="tangram-heartbeat", daemon=True)

    def start(self, app: Celery | None = None) -> None:
        """Start heart-beating: the scheduler retries this worker's actions if beats stop.

        With `app`, also watch the Celery consumer: if Redis answers but the consumer has not
        answered a ping for `stuck_after_pings` tries (it failed to reconnect after a broker
        restart), exit so that the supervisor restarts the worker; the scheduler retries its
        actions.
        """
        self.app = app
        self.report_sandboxes(force=True)
        self.store.heartbeat(self.name, self.pool_key)
        self._beat.start()

    def report_sandboxes(self, force: bool = False, every_s: float = 10.0) -> None:
        """Write the held sandboxes with the completion counter read *before* listing them
        (so a sandbox created by an action counted is listed), when changed or every `every_s`."""
        if self.held is None:
            return
        seq = self.seq
        held = sorted(self.held())
        now = time.monotonic()
        if force or self._reported != (seq, held) or now - self._reported_at >= every_s:
            self.store.report_sandboxes(self.name, seq, held)
            self._reported, self._reported_at = (seq, held), now
            self._report_images()

    def _report_images(self) -> None:
        """The node's images and kept layers, when they changed."""
        if self.images is None:
            return
        try:
            report = self.images()
        except Exception as e:  # a store that cannot be read must not stop the heartbeats
            log.warning("image report not made: %s", e)
            return
        if report is not None and report != self._images_reported:
            self.store.report_images(self.pool_key.split(":", 1)[1], report)
            self._images_reported = report

    def stop(self) -> None:
        self._stop.set()

    def _heartbeats(self, ping_every_s: float = 5.0, stuck_after_pings: int = 3) -> None:
        next_ping = time.monotonic() + ping_every_s
        consumer_seen = False
        missed = 0
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.store.r.ping()
                self.store.heartbeat(self.name, self.pool_key)
                self.report_sandboxes()
            except Exception:  # Redis away: keep trying, the scheduler decides what it means
                log.warning("heartbeat failed", exc_info=True)
                continue
            if self.app is None or time.monotonic() < next_ping:
                continue
            next_ping = time.monotonic() + ping_every_s
            answered = self._consumer_answers()
            if answered:
                consumer_seen, missed = True, 0
            elif consumer_seen:
                missed += 1
                if missed >= stuck_after_pings:
                    log.error("Celery consumer of %s is stuck; exiting for a restart", self.name)
                    os._exit(75)

    def _consumer_answers(self, timeout_s: float = 5.0) -> bool:
        """Does this worker's Celery consumer answer a ping? (In a thread: ping can hang.)"""
        assert self.app is not None
        app, name = self.app, self.name
        box: list[bool] = []

        def ping() -> None:
            try:
                box.append(bool(app.control.ping(destination=[name], timeout=1.0)))
            except Exception:
                box.append(False)

        t = threading.Thread(target=ping, name="tangram-consumer-ping", daemon=True)
        t.start()
        t.join(timeout_s)
        return bool(box and box[0])

    def execute(self, action_id: str, order_msg: dict[str, Any], handler: Handler) -> str:
        """Run one dispatched action exactly once; returns its final status (or why it was skipped).

        `order_msg` is the Celery message's order (`wire.TaskOrder`); one that does not parse is
        not run (the scheduler sends the action again when nobody claims it)."""
        order = self._order(action_id, order_msg)
        if order is None:
            return "skipped:malformed"
        claimed = self.store.claim(action_id, order.attempt, self.name, time.time(), order=order)
        self._closes(order, claimed)
        if not isinstance(claimed, Claim):
            return self._refused(action_id, order, claimed)
        with self.turns.turn(turn_key(order), self.batch_hand_back_s) as mine:
            if not mine:  # the batch before it on its cores still runs: placed again
                return self._hand_back(action_id, order, claimed, "its cores stayed busy")
            return self._run(action_id, order, claimed, handler)

    def execute_batch(self, items: list[list[Any]], handler: Handler) -> list[str]:
        """Run a CPU batch (an allocation and its riders, [action id, order] each) one after
        another on its cores; each exactly once, as `execute`. All are claimed first, in one
        round trip, so that none looks unclaimed to the scheduler while it waits its turn."""
        orders: list[tuple[str, TaskOrder]] = []
        out: list[str] = []
        for item in items:
            action_id = str(item[0]) if isinstance(item, list | tuple) and item else "?"
            order = self._order(
                action_id, item[1] if isinstance(item, list | tuple) and len(item) > 1 else None
            )
            if order is None:
                out.append("skipped:malformed")
            else:
                orders.append((action_id, order))
        claims = self.store.claim_many(
            [(aid, o.attempt) for aid, o in orders], self.name, time.time(), [o for _, o in orders]
        )
        for (_, order), claimed in zip(orders, claims, strict=True):
            self._closes(order, claimed)
        todo = [(aid, o, c) for (aid, o), c in zip(orders, claims, strict=True)]
        lock = threading.Lock()
        nxt = [0]  # the next to start; past the end once the rest was handed back

        def hand_back_rest() -> None:
            with lock:
                rest, nxt[0] = todo[nxt[0] :], len(todo)
            for action_id, order, claimed in rest:
                out.append(self._hand_back(action_id, order, claimed))

        # An action of the batch overran (its kind is short, this run hangs until its limit):
        # the riders not started yet go back to the scheduler instead of waiting for it. The
        # clock restarts with every action: a batch that moves on (each action slowed by a
        # sandbox start or a loaded machine) keeps its riders.
        key = turn_key(orders[0][1]) if orders else None
        with self.turns.turn(key, self.batch_hand_back_s) as mine:
            if not mine:  # the batch before it on its cores still runs: all placed again
                for action_id, order, claimed in todo:
                    out.append(self._hand_back(action_id, order, claimed, "its cores stayed busy"))
                return out
            clock = OverrunClock(self.batch_hand_back_s, hand_back_rest)
            if len(todo) > 1 and self.batch_hand_back_s > 0:
                clock.start()
            try:
                while True:
                    with lock:
                        i = nxt[0]
                        if i >= len(todo):
                            break
                        nxt[0] = i + 1
                    clock.restart()
                    out.append(self._run(*todo[i], handler))
            finally:
                clock.stop()
        return out

    def _hand_back(
        self,
        action_id: str,
        order: TaskOrder,
        claimed: Claim | Refused,
        what: str = "an action ahead of it in its batch ran",
    ) -> str:
        """Give a claimed, not started rider back to the scheduler, to be placed again."""
        if not isinstance(claimed, Claim):
            return f"skipped:{claimed}"
        tid = claimed.meta.trajectory_id
        why = f"{what} past {self.batch_hand_back_s:.1f} s"
        back = Completion(status=EventStatus.RETRY, error=why, trajectory_id=tid, unstarted=True)
        if self.store.give_back(action_id, self.name, order.attempt, back):
            log.info("action %s handed back: %s", action_id, why)
            self.metrics.outcomes.labels(pool=self.pool_key, status="handed_back").inc()
            return "handed_back"
        return "skipped:not_ours"

    def _order(self, action_id: str, order_msg: Any) -> TaskOrder | None:
        """The task order (None: unreadable)."""
        try:
            return TaskOrder.model_validate(order_msg)
        except ValueError as e:
            log.error("action %s: unreadable task order, not run: %s", action_id, e)
            return None

    def _closes(self, order: TaskOrder, claimed: Claim | Refused) -> None:
        """Remove the sandboxes the order's round evicted (`TaskOrder.closes`), before its action
        runs; not for an order the scheduler did not give (`Refused.UNORDERED`)."""
        if order.closes and self.closer is not None and claimed is not Refused.UNORDERED:
            for tid, gen in order.closes:
                self.closer(tid, gen)

    def _refused(self, action_id: str, order: TaskOrder, refused: Refused) -> str:
        """Report why a delivery was not run: an expired payload completes the action (rejected);
        any other refusal is a duplicate or superseded delivery, skipped."""
        if refused is Refused.EXPIRED:
            log.warning("action %s: payload expired before it ran (limits.queued_ttl_s)", action_id)
            res = ActionResult(
                action_id=action_id,
                status=ActionStatus.REJECTED,
                error="the action waited longer than limits.queued_ttl_s and its payload expired",
                attempts=order.attempt,
            )
            self.store.complete(action_id, res.model_dump_json(), Completion(status=EventStatus.REJECTED))
            return str(res.status)
        if refused is Refused.UNORDERED:
            log.error(
                "refused %s: its message is not the scheduler's order (no dispatch record of "
                "attempt %d on %s:%s with these cores); not run",
                action_id,
                order.attempt,
                order.kind,
                order.pool,
            )
            self.metrics.outcomes.labels(pool=self.pool_key, status="unordered").inc()
            return f"skipped:{refused}"
        log.info("skip %s: %s (duplicate or superseded delivery)", action_id, refused)
        self.metrics.duplicates.labels(pool=self.pool_key).inc()
        return f"skipped:{refused}"

    def _run(self, action_id: str, order: TaskOrder, claimed: Claim | Refused, handler: Handler) -> str:
        """Run a claimed action (or report why it was not claimed) and complete it."""
        if not isinstance(claimed, Claim):
            return self._refused(action_id, order, claimed)
        started = time.time()
        try:
            result = handler(action_id, claimed.payload, order)
        except Exception as e:  # an infrastructure failure: the user's code never raises here
            if self._retry(action_id, order, claimed.meta, e):
                return "retry"
            log.exception("action %s failed in the worker", action_id)
            result = ActionResult(
                action_id=action_id, status=ActionStatus.ERROR, error=f"{type(e).__name__}: {e}"
            )
        result = run_result(result, claimed.meta, order, started, time.time())
        with self._seq_lock:
            self.seq += 1
            seq = self.seq
        held, host = getattr(handler, "residency", None), getattr(handler, "host_residency", None)
        event = Completion.of(
            result,
            self.name,
            seq,
            residency(held()) if held is not None else None,
            residency(host()) if host is not None else None,
        )
        self.metrics.outcomes.labels(pool=self.pool_key, status=str(result.status)).inc()
        self.metrics.exec.labels(pool=self.pool_key).observe(result.exec_s)
        self.store.complete(action_id, result.model_dump_json(), event, claimed.notify)
        return str(result.status)

    def _retry(self, action_id: str, order: TaskOrder, meta: ActionMeta, e: Exception) -> bool:
        """Hand an action whose handler raised a retryable error back to be placed again;
        False when it is not retryable (or no longer this attempt's)."""
        back = Completion(
            status=EventStatus.RETRY, error=f"{type(e).__name__}: {e}", trajectory_id=meta.trajectory_id
        )
        if not getattr(e, "retryable", False) or not self.store.give_back(
            action_id, self.name, order.attempt, back
        ):
            return False
        log.warning("action %s: %s: %s; handed back to be placed again", action_id, type(e).__name__, e)
        self.metrics.outcomes.labels(pool=self.pool_key, status="retry").inc()
        return True


class OverrunClock:
    """Calls `on_overrun` once, from a thread of its own, when `limit_s` pass without a
    `restart` (the start of the batch's next action) or a `stop`."""

    def __init__(self, limit_s: float, on_overrun: Callable[[], None]) -> None:
        self.limit_s = limit_s
        self.on_overrun = on_overrun
        self._cond = threading.Condition()
        self._since = time.monotonic()
        self._stopped = False
        self._thread = threading.Thread(target=self._watch, name="tangram-batch-clock", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def restart(self) -> None:
        with self._cond:
            self._since = time.monotonic()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while not self._stopped:
                left = self._since + self.limit_s - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._stopped:
                return
        self.on_overrun()
