"""What workers report on the events stream: completions (units released, durations and GPU
restore costs learned, trajectories done), actions handed back or cancelled, and what GPU nodes
hold (on their devices and in host memory only)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from scheduler.estimator import DurationEstimator
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.resources import ClusterState
from scheduler.restore_cost import parse_tier
from scheduler.service.books import ActionBook
from scheduler.service.faults import Faults
from scheduler.service.record import RunRecorder
from scheduler.service.trajectories import TrajectoryBook
from scheduler.service.warmer import GpuWarmer
from tangram_celery.common.records import PinRecord
from tangram_celery.common.wire import (
    ChunkServices,
    Completion,
    EventStatus,
    ResidencyReport,
    parse_event,
    resident_map,
)
from tangram_celery.store import IntakeEntry, Store

log = logging.getLogger("tangram.scheduler")


def read_event(entry: IntakeEntry) -> Completion | ResidencyReport | None:
    """The entry's event; a malformed one is logged and, when it names an action, taken as an
    `error` completion (its units must come back all the same)."""
    try:
        return parse_event(entry.fields.get("event", "{}"))
    except ValueError as e:
        log.warning("malformed event %s: %s: %.200s", entry.stream_id, e, entry.fields.get("event"))
        return Completion(status=EventStatus.ERROR) if entry.fields.get("id") else None


class Events:
    """Carries out a page of the events stream on the books that own what each event changes."""

    def __init__(
        self,
        state: ClusterState,
        books: ActionBook,
        trajectories: TrajectoryBook,
        warmer: GpuWarmer,
        faults: Faults,
        store: Store,
        recorder: RunRecorder,
        estimator: DurationEstimator,
        clock: Callable[[], float],
    ) -> None:
        self.state, self.books, self.trajectories = state, books, trajectories
        self.warmer, self.faults, self.store = warmer, faults, store
        self.recorder, self.estimator, self.clock = recorder, estimator, clock
        self.progress_s = time.monotonic()  # when a page of events was last carried out

    def on_events(self, events: list[IntakeEntry]) -> None:
        if not events:
            return
        done: list[str] = []
        owners: dict[str, PinRecord] = {}  # pin records whose sandbox owner changed
        for e in events:
            action_id = e.fields.get("id", "")
            ev = read_event(e)
            if isinstance(ev, ResidencyReport):
                self.warmer.learn_residency(
                    ev.pool, resident_map(ev.resident), ev.warm, ev.error, _host_map(ev.host_resident)
                )
            elif ev is None:
                continue
            elif ev.status is EventStatus.RETRY:
                self.faults.retry_elsewhere(action_id, ev.error, unstarted=ev.unstarted)
            elif ev.status is EventStatus.CANCELLED:
                self.faults.drop_cancelled(action_id)
            elif self._completed(action_id, ev, owners):
                done.append(action_id)
        state = self.state
        self.store.events_done(
            done,
            {t: r for t, r in owners.items() if t in state.trajectory_node},
            [e.stream_id for e in events],
        )
        self.progress_s = time.monotonic()
        self.trajectories.close_ready()

    def _completed(self, action_id: str, ev: Completion, owners: dict[str, PinRecord]) -> bool:
        """An action's turn is over: release it, learn from it, note its trajectory's sandbox
        owner (in `owners`, when it changed). False if it is not running here (refused or
        replayed)."""
        alloc = self.state.release(action_id, self.clock())  # a use of its trajectory (eviction order)
        if alloc is None:
            return False
        if alloc.kind is ResourceKind.GPU and ev.resident is not None:
            self.warmer.learn_residency(
                alloc.pool, resident_map(ev.resident), host_resident=_host_map(ev.host_resident)
            )
        qa = self.books.forget(action_id)
        self.recorder.completed(qa, alloc, ev)
        if qa is not None:
            self._learn(qa, alloc, ev)
        # the scheduler's own key (a one-shot action's is not in the event)
        tid = qa.trajectory_id if qa is not None else ev.trajectory_id
        if not tid:
            return True
        if (
            alloc.kind is ResourceKind.CPU
            and self.state.trajectory_node.get(tid) == alloc.pool
            and self.trajectories.sandboxes.completed(tid, ev.worker, ev.seq)
        ):
            owners[tid] = self.trajectories.pin_record(tid)
        self.trajectories.done(tid)
        return True

    def _learn(self, qa: QueuedAction, alloc: Allocation, ev: Completion) -> None:
        """A sample of the action's duration for the estimator, if it ran to a result; and of
        its GPU restore, for the node's restore costs (`scheduler.restore_cost`), if it says
        which tier its model was found in."""
        tier = parse_tier(ev.load_tier) if alloc.kind is ResourceKind.GPU else None
        gnode = self.state.gpu.get(alloc.pool) if tier is not None else None
        if tier is not None and gnode is not None and gnode.restore_costs is not None and qa.target:
            gnode.restore_costs.observe(qa.target, tier, ev.load_s)
        if not (ev.status.ran and ev.exec_s):
            return
        exec_s: float | None = ev.exec_s
        if alloc.shares:  # slowed by sharing: what it takes alone is the CPU time it used
            exec_s = ev.cpu_s / alloc.units if ev.cpu_s else None
        if exec_s:
            self.estimator.observe(qa.kind, alloc.units, exec_s)


def _host_map(entries: list[ChunkServices] | None) -> dict[tuple[int, ...], list[str]] | None:
    """A report's host-memory map (None: the node has no host tier)."""
    return resident_map(entries) if entries is not None else None
