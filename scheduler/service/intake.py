"""Admitting intake entries into the waiting queue: close requests, cancel notices, new actions,
and the entries that can never run (refused with a result) or cannot even be read
(dead-lettered).

Every tenant has an intake of its own (`Store.intakes`); an entry's tenant is the intake it came
on, never a field of it. Its ids are the caller's own: they are qualified with its tenant here
(`tenants.qualify`), so a tenant's entries name only its own actions and trajectories. A named
tenant is the job identity of its work: job id = its name, priority = its class's
(`tenants.PRIORITY_OF_CLASS`), whatever the caller set; the default tenant (the operator's own)
keeps the caller's.

The metadata is checked with the same `PoolView.refusal` the clients apply at submit: a client
without the config, or an older one, may still send what cannot run here. It is parsed once;
the action book keeps it beside the queue entry made from it (`books.Tracked`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from scheduler.estimator import DurationEstimator
from scheduler.model import QueuedAction
from scheduler.service.books import ActionBook
from scheduler.service.cluster import CpuShape, to_queued
from scheduler.service.trajectories import TrajectoryBook
from tangram_celery.common.actions import ActionStatus
from tangram_celery.common.config import TangramConfig
from tangram_celery.common.metrics import SchedulerMetrics
from tangram_celery.common.tenants import DEFAULT, PRIORITY_OF_CLASS, SEP, TenantRecord, qualify
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
        self.tenants: dict[str, TenantRecord] = {}  # the registered tenants (the loop's copy)
        # a caller cancelled an action before dispatch (`Faults.drop_cancelled`; set by the loop)
        self.on_cancel: Callable[[str], None] = lambda action_id: None
        # why its tenant's caps can never hold an action (None: they can; set by the loop)
        self.cap_refusal: Callable[[QueuedAction], str | None] = lambda qa: None

    def on_intake(self, intake: list[IntakeEntry]) -> None:
        """Queue the new actions of `intake` (FCFS), note close requests and cancel notices,
        refuse the rest."""
        books = self.books
        rejected: list[str] = []
        for e in intake:
            f = e.fields
            if "control" in f:
                why = self._control(e)
                if why is not None:
                    if why:
                        self.dead_letter(e, why, finish=False)
                    rejected.append(e.ref)
                continue
            try:
                meta = ActionMeta.model_validate_json(f["meta"])
                if not meta.is_local:
                    raise ValueError(f"ids with {SEP!r} are not a caller's own")
                meta = self.own(meta, e.tenant)
                why = self.view.refusal(meta)
                qa = to_queued(meta, self.cfg, self.shape) if why is None else None
                over = self.cap_refusal(qa) if qa is not None else None
                if over is not None:  # it would wait for ever
                    qa, why = None, f"its tenant's quotas can never hold it: {over}"
            except (KeyError, TypeError, ValueError) as exc:  # ValidationError is a ValueError
                # Never raise out of the loop for one bad entry: recovery would read it again on
                # every restart (a crash loop). It goes to the dead-letter stream instead.
                self.dead_letter(e, f"malformed intake entry: {type(exc).__name__}: {exc}")
                rejected.append(e.ref)
                continue
            if qa is None:
                self.reject(meta, str(why))
                rejected.append(e.ref)
                continue
            if qa.action_id in books:
                # an entry read again (the intake is at-least-once): the action is already here
                log.warning("action %s is already queued or running; duplicate intake ignored", qa.action_id)
                rejected.append(e.ref)
                continue
            self.estimator.annotate(qa)
            books.admit(meta, qa, e.ref)
            self.trajectories.active[qa.trajectory_id] += 1
        self.store.ack(INTAKE, rejected)
        self.trajectories.close_ready()

    def own(self, meta: ActionMeta, tenant: str) -> ActionMeta:
        """`meta` of an entry of `tenant`'s intake as the scheduler keeps it: ids qualified, and
        for a named tenant its name as the job id and its class's priority."""
        if tenant == DEFAULT:
            return meta
        rec = self.tenants.get(tenant)
        update = {
            "id": qualify(tenant, meta.id),
            "trajectory_id": qualify(tenant, meta.trajectory_id),
            "job_id": tenant,
            "priority": PRIORITY_OF_CLASS[rec.quotas.priority if rec is not None else "normal"],
        }
        return meta.model_copy(update=update)

    def _control(self, e: IntakeEntry) -> str | None:
        """Carry out a control entry of its tenant's: close one of its trajectories (acknowledged
        once it is closed) or note that one of its actions was cancelled. Its ids are the
        caller's own, qualified with the tenant of its intake: a tenant reaches only its own.
        Returns None to keep the entry (a close waiting), "" to acknowledge it now, or why it
        is malformed (dead-lettered)."""
        f = e.fields
        kind, tid, action_id = f.get("control"), f.get("trajectory_id", ""), f.get("id", "")
        if SEP in tid or SEP in action_id:
            return f"malformed control entry: ids with {SEP!r} are not a caller's own"
        if kind == "close" and tid:
            self.trajectories.request_close(qualify(e.tenant, tid), e.ref)
            return None
        if kind == "cancel" and action_id:
            self.on_cancel(qualify(e.tenant, action_id))
            return ""
        return f"malformed control entry: {kind!r} with trajectory {tid!r}, action {action_id!r}"

    def dead_letter(self, entry: IntakeEntry, why: str, finish: bool = True) -> None:
        """Park a malformed intake entry in the dead-letter stream and, when it names an action
        (and `finish`: not a control entry), finish that action as `rejected` with the reason
        (its caller is waiting)."""
        log.error("intake entry %s of %s dead-lettered: %s", entry.stream_id, entry.tenant, why)
        self.metrics.rejected.inc()
        self.store.dead_letter(entry.stream_id, entry.fields, why)
        local_id = entry.fields.get("id", "") if finish else ""
        action_id = qualify(entry.tenant, local_id) if SEP not in local_id else ""
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
