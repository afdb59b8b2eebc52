"""What every worker does around its resource-specific handler.

claim (dispatched -> running, exactly once) -> load the payload -> run the handler -> store
the result, wake the client and emit the release event (one Lua script). A handler returns an
`ActionResult`-shaped dict of the user's outcome; infrastructure exceptions become status
`error` after the handler's own retries.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from celery import Celery

from tangram_celery.actions import ActionResult, ActionStatus
from tangram_celery.metrics import WorkerMetrics
from tangram_celery.store import Store

log = logging.getLogger("tangram.worker")

Handler = Callable[[str, dict[str, Any], dict[str, Any]], ActionResult]
"""handler(action_id, payload, allocation) -> ActionResult (timings are filled in by execute)."""


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

    def execute(self, action_id: str, alloc: dict[str, Any], handler: Handler) -> str:
        """Run one dispatched action exactly once; returns its final status (or why it was skipped)."""
        started = time.time()
        claimed = self.store.claim(action_id, int(alloc.get("attempt", 1)), self.name, started)
        if claimed == "expired":
            log.warning("action %s: payload expired before it ran (limits.queued_ttl_s)", action_id)
            res = ActionResult(
                action_id=action_id,
                status=ActionStatus.REJECTED,
                error="the action waited longer than limits.queued_ttl_s and its payload expired",
                attempts=int(alloc.get("attempt", 1)),
            )
            self.store.complete(
                action_id, res.model_dump_json(), {"status": str(res.status), "trajectory_id": ""}
            )
            return str(res.status)
        if isinstance(claimed, str):
            log.info("skip %s: %s (duplicate or superseded delivery)", action_id, claimed)
            self.metrics.duplicates.labels(pool=self.pool_key).inc()
            return f"skipped:{claimed}"
        meta_raw, payload_raw, _ = claimed
        meta = json.loads(meta_raw)
        payload = json.loads(payload_raw)
        try:
            result = handler(action_id, payload, alloc)
        except Exception as e:  # an infrastructure failure: the user's code never raises here
            attempt = int(alloc.get("attempt", 1))
            if getattr(e, "retryable", False) and self.store.give_back(
                action_id,
                self.name,
                attempt,
                {
                    "status": "retry",
                    "error": f"{type(e).__name__}: {e}",
                    "trajectory_id": meta["trajectory_id"],
                },
            ):
                log.warning(
                    "action %s: %s: %s; handed back to be placed again", action_id, type(e).__name__, e
                )
                self.metrics.outcomes.labels(pool=self.pool_key, status="retry").inc()
                return "retry"
            log.exception("action %s failed in the worker", action_id)
            result = ActionResult(
                action_id=action_id, status=ActionStatus.ERROR, error=f"{type(e).__name__}: {e}"
            )
        finished = time.time()
        result.trajectory_id = meta["trajectory_id"]
        submitted = float(meta["submitted_s"])
        result.queue_s = max(0.0, started - submitted)
        if not result.exec_s:
            result.exec_s = finished - started
        result.act_s = max(0.0, finished - submitted)
        result.units = int(alloc.get("units", 0))
        result.node = str(alloc.get("pool", ""))
        result.attempts = int(alloc.get("attempt", 1))
        if not result.batch_size:
            result.batch_size = int(alloc.get("batch", 1))
        with self._seq_lock:
            self.seq += 1
            seq = self.seq
        event = {
            "worker": self.name,
            "seq": seq,
            "status": str(result.status),
            "exec_s": result.exec_s,
            "queue_s": result.queue_s,
            "act_s": result.act_s,
            "units": result.units,
            "attempt": result.attempts,
            "trajectory_id": result.trajectory_id,
        }
        extra = getattr(handler, "event_extra", None)
        if extra is not None:
            event.update(extra())
        self.metrics.outcomes.labels(pool=self.pool_key, status=str(result.status)).inc()
        self.metrics.exec.labels(pool=self.pool_key).observe(result.exec_s)
        self.store.complete(action_id, result.model_dump_json(), event)
        return str(result.status)
