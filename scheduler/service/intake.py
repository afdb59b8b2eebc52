"""Admitting intake entries into the waiting queue: close requests, new actions, and the entries
that can never run (refused with a result) or cannot even be read (dead-lettered).

The metadata is checked with the same `PoolView.refusal` the clients apply at submit: a client
without the config, or an older one, may still send what cannot run here. It is parsed once;
the action book keeps it beside the queue entry made from it (`books.Tracked`)."""

from __future__ import annotations

import logging

from scheduler.estimator import DurationEstimator
from scheduler.service.books import ActionBook
from scheduler.service.cluster import CpuShape, to_queued
from scheduler.service.trajectories import TrajectoryBook
from tangram_celery.common.actions import ActionStatus
from tangram_celery.common.config import TangramConfig
from tangram_celery.common.metrics import SchedulerMetrics
from tangram_celery.common.wire import ActionMeta, ActionResult, PoolView
from tangram_celery.store import INTAKE, IntakeEntry, Store

log = logging.getLogger("tangram.scheduler")


class Intake:
    """Turns intake entries into queued actions (on `books`) and close requests."""

    def __init__(
        self,
        cfg: TangramConfig,
        view: PoolView,
        books: ActionBook,
        trajectories: TrajectoryBook,
        estimator: DurationEstimator,
        store: Store,
        metrics: SchedulerMetrics,
    ) -> None:
        self.cfg, self.view, self.books, self.trajectories = cfg, view, books, trajectories
        self.estimator, self.store, self.metrics = estimator, store, metrics
        self.shape: CpuShape | None = None  # the CPU nodes' shape once nodes joined (`nodes`)

    def on_intake(self, intake: list[IntakeEntry]) -> None:
        """Queue the new actions of `intake` (FCFS), note close requests, refuse the rest."""
        books = self.books
        rejected: list[str] = []
        for e in intake:
            f = e.fields
            if f.get("control") == "close" and f.get("trajectory_id"):
                self.trajectories.request_close(f["trajectory_id"], e.stream_id)
                continue
            try:
                meta = ActionMeta.model_validate_json(f["meta"])
                why = self.view.refusal(meta)
                qa = to_queued(meta, self.cfg, self.shape) if why is None else None
            except (KeyError, TypeError, ValueError) as exc:  # ValidationError is a ValueError
                # Never raise out of the loop for one bad entry: recovery would read it again on
                # every restart (a crash loop). It goes to the dead-letter stream instead.
                self.dead_letter(e, f"malformed intake entry: {type(exc).__name__}: {exc}")
                rejected.append(e.stream_id)
                continue
            if qa is None:
                self.reject(meta, str(why))
                rejected.append(e.stream_id)
                continue
            if qa.action_id in books:
                # an entry read again (the intake is at-least-once): the action is already here
                log.warning("action %s is already queued or running; duplicate intake ignored", qa.action_id)
                rejected.append(e.stream_id)
                continue
            self.estimator.annotate(qa)
            books.admit(meta, qa, e.stream_id)
            self.trajectories.active[qa.trajectory_id] += 1
        self.store.ack(INTAKE, rejected)
        self.trajectories.close_ready()

    def dead_letter(self, entry: IntakeEntry, why: str) -> None:
        """Park a malformed intake entry in the dead-letter stream and, when it names an action,
        finish that action as `rejected` with the reason (its caller is waiting)."""
        log.error("intake entry %s dead-lettered: %s", entry.stream_id, why)
        self.metrics.rejected.inc()
        self.store.dead_letter(entry.stream_id, entry.fields, why)
        action_id = entry.fields.get("id", "")
        if action_id and self.store.action_state(action_id) not in (None, "done"):
            res = ActionResult(
                action_id=action_id, status=ActionStatus.REJECTED, error=why[:2000], attempts=0
            )
            self.store.finish_unrun(action_id, res.model_dump_json(), "")

    def reject(self, meta: ActionMeta, why: str) -> None:
        """Finish an action that can never run here as `rejected`, with the reason."""
        log.warning("rejected action %s: %s", meta.id, why)
        self.metrics.rejected.inc()
        res = ActionResult(
            action_id=meta.id,
            trajectory_id=meta.trajectory_id,
            status=ActionStatus.REJECTED,
            error=why,
            attempts=0,
        )
        self.store.finish_unrun(meta.id, res.model_dump_json(), "")
