"""SchedulerService: the control loop around a pure policy.

Each step: read intake + completion events (one blocking XREADGROUP over both streams) ->
release finished units -> admit new actions into the FCFS waiting queue -> `policy.decide` ->
persist the allocations -> send the Celery messages -> acknowledge the intake entries.

Crash safety: an intake entry is acknowledged only after its allocation is persisted in
`tangram:running` and its message is sent. On restart the service rebuilds its resource state
from `running`, re-reads its unacknowledged entries, and re-sends any whose allocation was
persisted; workers claim actions with a compare-and-set, so a re-sent message never runs an
action twice.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from kombu.exceptions import KombuError

from scheduler.estimator import DurationEstimator
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies import Policy, get_policy
from scheduler.queue import WaitingQueue
from scheduler.round import FairShareSpec, Round
from scheduler.service import trajectories
from scheduler.service.cluster import build_cluster, check_meta, pool_view, to_queued
from scheduler.service.liveness import LivenessPolicy
from scheduler.service.liveness import check as liveness_check
from scheduler.service.record import RunRecorder
from scheduler.service.recovery import recover
from scheduler.service.sandboxes import SandboxBook, caller_trajectory, is_one_shot
from tangram_celery.actions import ActionResult, ActionStatus
from tangram_celery.app import TASK_API, TASK_CPU, TASK_GPU, make_app, queue_name
from tangram_celery.config import TangramConfig
from tangram_celery.errors import BrokerError
from tangram_celery.store import EVENTS, INTAKE, IntakeEntry, Store

log = logging.getLogger("tangram.scheduler")

_TASKS = {ResourceKind.CPU: TASK_CPU, ResourceKind.GPU: TASK_GPU, ResourceKind.API: TASK_API}
_TRANSIENT = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.ResponseError,
    BrokerError,
    KombuError,
    OSError,
)
# what a malformed intake entry raises while it is parsed and costed
_MALFORMED = (KeyError, IndexError, TypeError, ValueError, AssertionError, AttributeError)


def _is_oom(e: Exception) -> bool:
    return str(e).startswith("OOM")


class SchedulerService:
    """The central scheduler process. `run()` loops until `stop()`; `step()` does one round."""

    def __init__(
        self,
        cfg: TangramConfig,
        broker_url: str,
        *,
        policy: Policy | None = None,
        clock: Callable[[], float] = time.time,
        record: bool = True,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.store = Store(broker_url)
        self.app = make_app(broker_url)
        self.policy = policy or get_policy(cfg.scheduler.policy)
        fair = cfg.scheduler.fair_share
        self.round = Round(
            self.policy,
            fair=FairShareSpec(fair.weights, fair.aging_s) if fair.enabled else None,
            max_batch=lambda m: getattr(cfg.reward_model(m), "max_batch", 1),
        )
        self.view = pool_view(cfg)
        self.estimator = DurationEstimator.from_config(
            {k: {"t1_s": v.t1_s, "p": v.parallel_fraction} for k, v in cfg.scheduler.priors.items()}
        )
        self.liveness = LivenessPolicy()
        self.recorder = RunRecorder(Path(cfg.state_dir) / "actions.jsonl" if record else None)
        self.metrics = self.recorder.metrics
        self.dispatched_total = 0
        self.progress_s = time.monotonic()  # last dispatch or completion
        self._stall_logged_s = 0.0
        self._reset()
        self._stop = threading.Event()

    # ---- lifecycle -------------------------------------------------------------------------
    def _reset(self) -> None:
        """Forget everything in memory; `start()` rebuilds it from Redis."""
        self.state = build_cluster(self.cfg)
        self.waiting = WaitingQueue()  # FCFS, indexed by pinned node (scheduler/queue.py)
        self.entry_of: dict[str, str] = {}  # action id -> intake stream id (unacked)
        self.kind_of: dict[str, str] = {}  # running action id -> duration-profile kind
        self.active: Counter[str] = Counter()  # trajectory -> queued + running actions
        self.closing: dict[str, str] = {}  # trajectory -> stream id of its close request
        self.attempt: dict[str, int] = {}  # dispatched action -> attempt number
        self.running_qa: dict[str, QueuedAction] = {}  # dispatched action -> its queue entry
        self.offline: set[str] = set()  # pool keys with no live worker
        self.last_active: dict[str, float] = {}  # pinned trajectory -> last dispatch/completion
        self.book = SandboxBook()  # sandbox generations, owners, pending resets
        self.sandbox_of: dict[str, dict[str, Any]] = {}  # dispatched CPU action -> sandbox instructions

    def start(self) -> None:
        """Connect, publish the pool view, and recover state left by a previous run."""
        self.store.ping()
        self.store.ensure_groups()
        self.store.publish_config(self.view)
        recover(self)

    def stop(self) -> None:
        self._stop.set()

    def _rejoin(self, max_delay_s: float = 2.0) -> None:
        """Wait for Redis to come back, then rebuild all state from it."""
        delay_s = 0.1
        while not self._stop.is_set():
            try:
                self._reset()
                self.start()
                log.info("Redis is back: %d waiting, %d running", len(self.waiting), len(self.state.running))
                return
            except _TRANSIENT as e:
                if isinstance(e, redis.ResponseError) and not _is_oom(e):
                    raise
                self._stop.wait(delay_s)
                delay_s = min(delay_s * 2, max_delay_s)

    def run(self, idle_block_ms: int = 200) -> None:
        self.start()
        log.info(
            "scheduler up: policy=%s, %d waiting, %d running after recovery",
            self.policy.name,
            len(self.waiting),
            len(self.state.running),
        )
        next_check = 0.0
        while not self._stop.is_set():
            try:
                # API pools refill over time: wake up often while API actions wait for quota.
                wait_api = any(a.cost.key is ResourceKind.API for a in self.waiting[:64])
                self.step(block_ms=20 if wait_api else idle_block_ms)
                if time.monotonic() >= next_check:
                    liveness_check(self, self.liveness)
                    trajectories.expire_idle(self, self.clock())
                    self.warn_if_stalled()
                    self.recorder.snapshot(self.waiting, self.state, self.offline)
                    self.recorder.flush()
                    next_check = time.monotonic() + self.liveness.check_every_s
            except _TRANSIENT as e:
                if isinstance(e, redis.ResponseError) and not _is_oom(e):
                    raise
                # Redis restarted, failed over, or refused a write at its memory ceiling (then the
                # round may have been half applied): what Redis kept is the truth; rebuild from it.
                log.warning("lost Redis (%s); rebuilding state once it is back", e)
                self._rejoin()
        self.recorder.close()
        self.store.close()

    # ---- one round -------------------------------------------------------------------------
    def step(self, block_ms: int | None = 0) -> int:
        """Process what is readable (blocking up to block_ms) and dispatch; returns #dispatched."""
        intake, events = self.store.read(self.cfg.scheduler.batch_size, block_ms)
        self.on_events(events)
        self.on_intake(intake)
        return self._schedule()

    def on_events(self, events: list[IntakeEntry]) -> None:
        if not events:
            return
        done: list[str] = []
        owners: dict[str, dict[str, Any]] = {}  # pin records whose sandbox owner changed
        for e in events:
            action_id = e.fields["id"]
            ev = json.loads(e.fields.get("event", "{}"))
            if ev.get("type") == "residency":
                self._learn_residency(str(ev.get("pool", "")), ev.get("resident"))
                continue
            if ev.get("status") == "retry":
                self._retry_elsewhere(action_id, str(ev.get("error", "")))
                continue
            if ev.get("status") == "cancelled":
                self._drop_cancelled(action_id)
                continue
            alloc = self._release(action_id)
            if alloc is not None and alloc.kind is ResourceKind.GPU and "resident" in ev:
                self._learn_residency(alloc.pool, ev["resident"])
            if alloc is not None:
                done.append(action_id)
                self.attempt.pop(action_id, None)
                self.sandbox_of.pop(action_id, None)
                qa = self.running_qa.pop(action_id, None)
                self.recorder.completed(qa, alloc, ev)
                kind = self.kind_of.pop(action_id, ev.get("kind", ""))
                if ev.get("status") in (ActionStatus.OK, ActionStatus.FAILED) and ev.get("exec_s"):
                    self.estimator.observe(kind, alloc.units, float(ev["exec_s"]))
                # the scheduler's own key (a one-shot action's is not in the event)
                tid = qa.trajectory_id if qa is not None else ev.get("trajectory_id")
                if tid:
                    if (
                        alloc.kind is ResourceKind.CPU
                        and self.state.trajectory_node.get(tid) == alloc.pool
                        and self.book.completed(tid, str(ev.get("worker", "")), int(ev.get("seq", 0)))
                    ):
                        owners[tid] = trajectories.pin_record(self, tid)
                    trajectories.done(self, tid)
        self.store.forget_running(done)
        self.store.update_pins({t: r for t, r in owners.items() if t in self.state.trajectory_node})
        self.store.ack(EVENTS, [e.stream_id for e in events])
        self.progress_s = time.monotonic()
        trajectories.close_ready(self)

    def _learn_residency(self, pool: str, resident: Any) -> None:
        """What GPU node `pool` holds ("0,1" -> models), from a completion or a warm-up event:
        placement prefers those chunks (no restore). A malformed map is ignored, not fatal."""
        node = self.state.gpu.get(pool)
        if node is None or not isinstance(resident, dict):
            return
        try:
            node.resident = {
                tuple(int(g) for g in chunk.split(",")): [str(m) for m in models]
                for chunk, models in resident.items()
            }
        except (AttributeError, TypeError, ValueError):
            log.warning("ignored a malformed residency report for %s: %.200r", pool, resident)

    def on_intake(self, intake: list[IntakeEntry]) -> None:
        rejected: list[str] = []
        for e in intake:
            f = e.fields
            if f.get("control") == "close" and f.get("trajectory_id"):
                self.closing[f["trajectory_id"]] = e.stream_id
                continue
            try:
                meta = json.loads(f["meta"])
                if not isinstance(meta, dict):
                    raise TypeError(f"meta is a JSON {type(meta).__name__}, not an object")
                why = check_meta(meta, self.view)
                qa = to_queued(meta, self.cfg) if why is None else None
            except _MALFORMED as exc:
                # Never raise out of the loop for one bad entry: recovery would read it again on
                # every restart (a crash loop). It goes to the dead-letter stream instead.
                self._dead_letter(e, f"malformed intake entry: {type(exc).__name__}: {exc}")
                rejected.append(e.stream_id)
                continue
            if qa is None:
                self._reject(meta, str(why))
                rejected.append(e.stream_id)
                continue
            if qa.action_id in self.waiting or qa.action_id in self.running_qa:
                # an entry read again (the intake is at-least-once): the action is already here
                log.warning("action %s is already queued or running; duplicate intake ignored", qa.action_id)
                rejected.append(e.stream_id)
                continue
            self.estimator.annotate(qa)
            self.waiting.append(qa)
            self.entry_of[qa.action_id] = e.stream_id
            self.active[qa.trajectory_id] += 1
        self.store.ack(INTAKE, rejected)
        trajectories.close_ready(self)

    def _dead_letter(self, entry: IntakeEntry, why: str) -> None:
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

    def _schedule(self) -> int:
        if not self.waiting:
            return 0
        now = self.clock()
        plan = self.round.plan(self.waiting, self.state, now)
        self.metrics.decision.observe(plan.decision_s)
        allocs, riders = plan.allocs, plan.riders
        if not allocs:
            return 0
        by_id = {a.action_id: self.waiting.action(a.action_id) for a in plan.started}
        pins: dict[str, dict[str, Any]] = {}
        records: list[tuple[str, dict[str, Any]]] = []
        to_close: list[tuple[str, str, str]] = []  # (node, trajectory, generation) evicted
        resets_done: list[str] = []
        for alloc in allocs:
            qa = by_id[alloc.action_id]
            tid = qa.trajectory_id
            fresh = tid not in self.state.trajectory_node
            sandboxed = alloc.kind is ResourceKind.CPU and qa.cost.sandbox
            held = (
                0 if fresh or not sandboxed else self.state.cpu[alloc.pool].trajectory_memory_mb.get(tid, 0)
            )
            self.state.apply(alloc, qa, now)
            if alloc.evict:
                gens = trajectories.evicted(self, alloc, now)
                to_close += [(alloc.pool, t, g) for t, g in gens.items()]
            if sandboxed and not is_one_shot(tid):
                if fresh:
                    info = self.book.pinned(tid, alloc.action_id, now)
                    if info["reset"]:
                        resets_done.append(tid)
                else:
                    info = self.book.reuse(tid, alloc.action_id)
                if fresh or self.state.cpu[alloc.pool].trajectory_memory_mb.get(tid, 0) != held:
                    pins[tid] = trajectories.pin_record(self, tid)  # new, or a larger reservation
                self.sandbox_of[alloc.action_id] = info
            attempt = self.attempt.get(alloc.action_id, 0) + 1
            self.attempt[alloc.action_id] = attempt
            records.append(
                (alloc.action_id, _record(alloc, qa, attempt, self.sandbox_of.get(alloc.action_id)))
            )
            self.kind_of[alloc.action_id] = qa.kind
            self.running_qa[alloc.action_id] = qa
        for alloc in riders:
            qa = by_id[alloc.action_id]
            self.state.share(alloc, qa, now)
            attempt = self.attempt.get(alloc.action_id, 0) + 1
            self.attempt[alloc.action_id] = attempt
            records.append((alloc.action_id, _record(alloc, qa, attempt)))
            self.kind_of[alloc.action_id] = qa.kind
            self.running_qa[alloc.action_id] = qa
        allocs = allocs + riders
        started = {a.action_id for a in allocs}
        entries = [e for e in (self.entry_of.pop(i, None) for i in started) if e is not None]
        evicted = [t for _, t, _ in to_close]
        resets = {t: self.book.reset[t] for t in evicted if t in self.book.reset}
        skipped = set(
            self.store.mark_dispatched(
                records, pins, entries, now, forget_pins=evicted, resets=resets, resets_done=resets_done
            )
        )
        for node, tid, gen in to_close:  # evicted whether or not their evicter was cancelled
            trajectories.send_close(self, node, tid, gen)
        for action_id in started:
            self.waiting.pop(action_id)
        if skipped:  # cancelled after the policy chose them: undo, send nothing
            for action_id in skipped:
                self._undo_dispatch(action_id)
            allocs = [a for a in allocs if a.action_id not in skipped]
        self.send(allocs)
        self.recorder.dispatched(allocs)
        self.dispatched_total += len(allocs)
        self.progress_s = time.monotonic()
        return len(allocs)

    def send(self, allocs: list[Allocation]) -> None:
        """Publish one Celery message per allocation, pipelined into one Redis round trip.

        Results flow through the Tangram store, so Celery's result backend is not involved
        (ignore_result). The arguments' repr, which Flower shows and searches, names the action's
        kind and trajectory. `batch` counts the actions sent together on the same pool (on a GPU
        node: the same chunk, i.e. one batch of reward requests).
        """
        batch = Counter(_batch_key(a) for a in allocs)
        with self.app.producer_or_acquire() as producer, producer.batch(max_size=1000):
            for alloc in allocs:
                qa = self.running_qa.get(alloc.action_id)
                what = f"kind={qa.kind}, trajectory={qa.trajectory_id}, " if qa is not None else ""
                record = {
                    **alloc.to_dict(),
                    "attempt": self.attempt[alloc.action_id],
                    "batch": batch[_batch_key(alloc)],
                }
                sandbox = self.sandbox_of.get(alloc.action_id)
                if sandbox is not None:
                    record["sandbox"] = sandbox
                self.app.send_task(
                    _TASKS[alloc.kind],
                    args=[alloc.action_id, record],
                    task_id=alloc.action_id,
                    queue=queue_name(str(alloc.kind), alloc.pool),
                    producer=producer,
                    ignore_result=True,
                    argsrepr=f"[{alloc.action_id!r}, {what}units={alloc.units}]",
                    kwargsrepr="{}",
                )

    def warn_if_stalled(self, after_s: float = 30.0) -> None:
        """Say why nothing moves when actions wait and nothing ran or ended for `after_s`."""
        now = time.monotonic()
        if not self.waiting or now - self.progress_s < after_s or now - self._stall_logged_s < after_s:
            return
        self._stall_logged_s = now
        head = self.waiting[0]
        pin = self.state.trajectory_node.get(head.trajectory_id, "-")
        cpu = {n: (len(c.free), c.memory_free_mb) for n, c in self.state.cpu.items()}
        log.warning(
            "no progress for %.0f s with %d waiting: head %s (trajectory %s pinned to %s, %s %s units); "
            "cpu free (cores, MiB)=%s; offline=%s; running=%d",
            now - self.progress_s,
            len(self.waiting),
            head.action_id,
            head.trajectory_id,
            pin,
            head.cost.key,
            head.cost.units.min,
            cpu,
            sorted(self.offline),
            len(self.state.running),
        )

    # ---- trajectories (scheduler.service.trajectories) ----------------------------------------
    def expire_idle(self, now_s: float) -> None:
        trajectories.expire_idle(self, now_s)

    def reconcile_sandboxes(self, alive: set[str], reports: dict[str, dict[str, Any]]) -> None:
        trajectories.reconcile(self, alive, reports)

    # ---- faults (driven by scheduler.service.liveness) ----------------------------------------
    def set_offline(self, pools: set[str]) -> None:
        """Take CPU/GPU pools without live workers out of placement; bring returning ones back."""
        for key in pools - self.offline:
            log.warning("pool %s has no live worker: offline", key)
            kind, _, name = key.partition(":")
            if kind == "cpu":
                # Its trajectories start over elsewhere: otherwise their next actions would wait
                # for the node forever, and under FCFS everything behind them with them.
                lost = [t for t, n in self.state.trajectory_node.items() if n == name]
                for tid in lost:
                    trajectories.release(self, tid, lost=True, remove=False)
                if lost:
                    log.warning("%d trajectories pinned to %s unpinned", len(lost), name)
        for key in self.offline - pools:
            log.info("pool %s is back", key)
        self.offline = set(pools)
        for name, node in self.state.cpu.items():
            held = {
                c
                for a in self.state.running.values()
                if a.pool == name and a.kind is ResourceKind.CPU
                for c in a.unit_ids
            }
            node.online = f"cpu:{name}" not in self.offline
            node.free = {c for g in node.numa for c in g} - held if node.online else set()
        for name, gnode in self.state.gpu.items():
            held = {
                c
                for a in self.state.running.values()
                if a.pool == name and a.kind is ResourceKind.GPU
                for c in a.unit_ids
            }
            gnode.free = set() if f"gpu:{name}" in self.offline else set(range(gnode.num_gpus)) - held

    def _release(self, action_id: str) -> Allocation | None:
        """Free the units of `action_id`; on an offline pool they stay out of placement."""
        alloc = self.state.release(action_id)
        if alloc is not None and f"{alloc.kind}:{alloc.pool}" in self.offline:
            if alloc.kind is ResourceKind.CPU:
                self.state.cpu[alloc.pool].free.difference_update(alloc.unit_ids)
            elif alloc.kind is ResourceKind.GPU:
                self.state.gpu[alloc.pool].free.difference_update(alloc.unit_ids)
        return alloc

    def retry(self, action_id: str, worker: str, attempt: int, max_attempts: int) -> None:
        """The worker running `action_id` died, or its message was lost before any worker claimed
        it (`worker` empty): send it again on the same pool as a new attempt, within a bound."""
        alloc = self.state.running[action_id]
        if attempt >= max_attempts:
            self._give_up(action_id, f"its worker was lost {attempt} time(s)")
            return
        if self.store.requeue(action_id, worker, "dispatched", attempt + 1, self.clock()):
            why = f"worker {worker} was lost" if worker else "it was never claimed"
            log.warning("action %s: %s; retrying (attempt %d)", action_id, why, attempt + 1)
            self.attempt[action_id] = attempt + 1
            self.metrics.retries.inc()
            self.send([alloc])

    def reroute(self, action_id: str, worker: str, attempt: int, max_attempts: int) -> None:
        """The pool of `action_id` is gone: put it back at the front of the waiting queue."""
        if attempt >= max_attempts:
            self._give_up(action_id, f"its pool was lost {attempt} time(s)")
            return
        qa = self.running_qa.get(action_id)
        if qa is None or not self.store.requeue(action_id, worker, "queued", attempt, self.clock()):
            return
        alloc = self._back_to_queue(action_id)
        log.warning("pool of %s is offline; re-routing (was on %s)", action_id, alloc and alloc.pool)
        self.metrics.reroutes.inc()
        if alloc is not None and alloc.kind is ResourceKind.CPU and qa.cost.sandbox:
            # its sandbox is gone with the node
            trajectories.release(self, qa.trajectory_id, lost=True, remove=False)

    def forget_vanished(self, action_id: str) -> None:
        """The action's record is gone from Redis (expired, or deleted by hand): free its units."""
        log.error("action %s has no record in Redis any more; releasing its units", action_id)
        self._release(action_id)
        qa = self.running_qa.pop(action_id, None)
        self.kind_of.pop(action_id, None)
        self.attempt.pop(action_id, None)
        self.store.forget_running([action_id])
        self.sandbox_of.pop(action_id, None)
        if qa is not None:
            trajectories.done(self, qa.trajectory_id)

    def _retry_elsewhere(self, action_id: str, error: str) -> None:
        """A worker handed `action_id` back after a retryable failure (its reward server crashed
        mid-batch, a replica failed to load): place it again, within the attempt bound."""
        if action_id not in self.state.running:
            return  # already re-placed (an event replayed after a restart)
        attempt = self.attempt.get(action_id, 1)
        if attempt >= self.liveness.max_attempts:
            self._give_up(action_id, f"{attempt} attempt(s) failed, last: {error}")
            return
        alloc = self._back_to_queue(action_id)
        log.warning("action %s failed on %s (%s); placing it again", action_id, alloc and alloc.pool, error)
        self.metrics.retries.inc()

    def _back_to_queue(self, action_id: str) -> Allocation | None:
        """Release the units of a dispatched action and put it back in the waiting queue, in
        FCFS order (its Redis state is already 'queued')."""
        alloc = self._release(action_id)
        qa = self.running_qa.pop(action_id, None)
        self.kind_of.pop(action_id, None)
        self.sandbox_of.pop(action_id, None)
        if qa is not None:
            self.waiting.append(qa)
            self.waiting.sort_by_submission()
        return alloc

    def _drop_cancelled(self, action_id: str) -> None:
        """A caller cancelled `action_id` before it was dispatched (the store script made sure
        of that and removed its intake entry): forget it. Idempotent; an action the dispatch
        script already skipped is gone from the queue and is ignored here."""
        qa = self.waiting.get(action_id)
        if qa is None:
            return
        self.waiting.pop(action_id)
        self.entry_of.pop(action_id, None)
        trajectories.done(self, qa.trajectory_id)
        self.metrics.cancelled.inc()

    def _undo_dispatch(self, action_id: str) -> None:
        """The store refused to dispatch `action_id` (cancelled meanwhile): give its units back,
        and the pin it made, if it pinned its trajectory and nothing else of it runs."""
        self._release(action_id)
        self.attempt.pop(action_id, None)
        self.kind_of.pop(action_id, None)
        info = self.sandbox_of.pop(action_id, None)
        qa = self.running_qa.pop(action_id, None)
        if qa is not None:
            tid = qa.trajectory_id
            if info is not None and info.get("new") and not self.state.trajectory_running.get(tid):
                trajectories.unpin_undone(self, tid, reset=bool(info.get("reset")))
            trajectories.done(self, tid)
        self.metrics.cancelled.inc()
        log.info("action %s was cancelled before dispatch; not sent", action_id)

    def _give_up(self, action_id: str, why: str) -> None:
        qa = self.running_qa.get(action_id)
        tid = caller_trajectory(qa.trajectory_id) if qa else ""
        res = ActionResult(
            action_id=action_id,
            trajectory_id=tid,
            status=ActionStatus.ERROR,
            error=f"infrastructure failure: {why}",
            attempts=self.attempt.get(action_id, 0),
        )
        self.store.finish_unrun(action_id, res.model_dump_json(), tid)

    def _reject(self, meta: dict[str, Any], why: str) -> None:
        log.warning("rejected action %s: %s", meta.get("id"), why)
        self.metrics.rejected.inc()
        res = ActionResult(
            action_id=meta["id"],
            trajectory_id=meta.get("trajectory_id", ""),
            status=ActionStatus.REJECTED,
            error=why,
            attempts=0,
        )
        self.store.finish_unrun(meta["id"], res.model_dump_json(), "")


def _batch_key(alloc: Allocation) -> tuple[str, str, tuple[int, ...]]:
    """Actions with one key were sent as one batch: same pool, and on a GPU node the same chunk."""
    return str(alloc.kind), alloc.pool, alloc.unit_ids if alloc.kind is ResourceKind.GPU else ()


def _record(
    alloc: Allocation, qa: QueuedAction, attempt: int, sandbox: dict[str, Any] | None = None
) -> dict[str, Any]:
    lo, hi = qa.cost.units.min, qa.cost.units.max
    meta: dict[str, Any] = {
        "id": qa.action_id,
        "trajectory_id": qa.trajectory_id,
        "submitted_s": qa.submitted_s,
        "job_id": qa.job_id,
        "priority": qa.priority,
    }
    if is_one_shot(qa.trajectory_id):
        meta["ephemeral"] = True
    if qa.kind.startswith("reward:"):
        meta.update(type="reward", model=qa.target)
    elif qa.cost.key is ResourceKind.CPU:
        meta.update(type="code", cpus=[lo, hi], memory_mb=qa.cost.memory_mb, has_tests=qa.kind == "tests")
    else:
        meta.update(type="api", api=qa.target)
    rec: dict[str, Any] = {"alloc": alloc.to_dict(), "meta": meta, "attempt": attempt}
    if sandbox is not None:
        rec["sandbox"] = sandbox
    return rec
