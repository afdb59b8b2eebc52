"""SchedulerService: the control loop around one scheduling round.

Each step: read intake + completion events (one blocking XREADGROUP over both streams) ->
release finished units (`events`) -> admit new actions into the FCFS waiting queue (`intake`)
-> one round (`scheduler.round.Round`, the simulator's round too) -> persist the dispatch
records, acknowledge the intake entries and send the Celery messages (`dispatch`). Every
`check_every_s`: a liveness pass (`liveness.assess`, carried out by `Faults.apply`), idle
sandboxes expired, metrics refreshed.

State has owners, as in Ray Serve's controller: the action book (`books.ActionBook`: the
waiting queue and every action held), the trajectory book (`trajectories.TrajectoryBook`: pins'
sandboxes, close requests, idle times), the GPU warmer (`warmer.GpuWarmer`: warm orders under
way) and the sender (`sender.Sender`: every Celery message); the resource state
(`ClusterState`) is the round's. The handlers (`intake.Intake`, `events.Events`,
`dispatch.Dispatcher`, `faults.Faults`) act on the books that own what they change. Managers
decide, the loop applies: liveness and recovery return plans, the round returns a plan, and
only the loop calls what carries them out; the periodic pass updates each manager in its own
`try`, so that one failing does not stop the others.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis
from celery import Celery
from kombu.exceptions import KombuError

from scheduler.estimator import DurationEstimator
from scheduler.model import QueuedAction, ResourceKind
from scheduler.policies import Policy
from scheduler.queue import WaitingQueue
from scheduler.restore_cost import RestoreCosts
from scheduler.round import FairShareSpec, Round
from scheduler.service.books import ActionBook
from scheduler.service.cluster import CpuShape, build_cluster, gpu_footprint, learn_images
from scheduler.service.dispatch import Dispatcher
from scheduler.service.events import Events
from scheduler.service.faults import Faults
from scheduler.service.intake import Intake
from scheduler.service.liveness import LivenessPolicy, assess
from scheduler.service.nodes import NodeBook, node_gauges
from scheduler.service.record import RunRecorder
from scheduler.service.recovery import RecoveryPlan, recovery_plan
from scheduler.service.sender import Sender
from scheduler.service.trajectories import EvictionTally, TrajectoryBook
from scheduler.service.warmer import GpuWarmer
from scheduler.tenancy import refusal
from tangram_celery.common.config import TangramConfig
from tangram_celery.common.errors import BrokerError
from tangram_celery.common.metrics import SchedulerMetrics
from tangram_celery.common.node_record import NodeState, live_pools
from tangram_celery.common.wire import PoolView
from tangram_celery.store import EVENTS, IntakeEntry, Store
from tangram_celery.transport.app import make_app

log = logging.getLogger("tangram.scheduler")

NODES_EVERY_S = 0.25  # how often the nodes' records are read between liveness passes
TENANTS_EVERY_S = 1.0  # how often the tenant registry is read and Redis's memory published

_TRANSIENT = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.ResponseError,
    BrokerError,
    KombuError,
    OSError,
)


def gpu_services(cfg: TangramConfig) -> dict[str, tuple[int, ...]]:
    """The GPU reward services configured, with their chunk sizes: the seed of warm placement's
    demand (`scheduler.policies.warm_gpu.GpuDemand`)."""
    return {m.name: tuple(m.dop_options) for m in cfg.reward_models if m.backend != "rule"}


def _is_oom(e: Exception) -> bool:
    return str(e).startswith("OOM")


class SchedulerService:
    """The central scheduler process. `run()` loops until `stop()`; `step()` does one round.

    `store` and `app` default to ones connected to `broker_url`; tests pass their in-memory
    twins (`tangram_celery.testing`), and may pass the duration `estimator`."""

    def __init__(
        self,
        cfg: TangramConfig,
        broker_url: str,
        *,
        policy: Policy | None = None,
        clock: Callable[[], float] = time.time,
        record: bool = True,
        store: Store | None = None,
        app: Celery | None = None,
        estimator: DurationEstimator | None = None,
    ) -> None:
        self.cfg = cfg
        self.view = PoolView.of(cfg)
        self.policy = policy or cfg.scheduler.make_policy()
        priors = {k: v.model_dump() for k, v in cfg.scheduler.priors.items()}
        self.estimator = estimator or DurationEstimator.from_config(priors)
        self.clock = clock
        self.liveness = LivenessPolicy()
        self.store = store or Store(broker_url)
        self.recorder = RunRecorder(
            Path(cfg.state_dir) / "actions.jsonl" if record else None,
            max_bytes=cfg.scheduler.run_log_max_mb << 20,
            keep=cfg.scheduler.run_log_keep,
        )
        self.sender = Sender(app or make_app(broker_url), self.recorder.metrics)
        self.tally = EvictionTally()
        self.dispatched_total = 0
        self.restore_costs = RestoreCosts()  # learned from completions; kept across `_reset`
        self._build()
        self._stall_logged_s = 0.0
        self._stop = threading.Event()

    def _build(self) -> None:
        """The resource state, the books and the handlers, all fresh (`start()` recovers them)."""
        cfg, store, sender, clock, metrics = self.cfg, self.store, self.sender, self.clock, self.metrics
        self.state = state = build_cluster(cfg, self.restore_costs)
        self.books = books = ActionBook()
        self.trajectories = trajectories = TrajectoryBook(
            state, store, sender, clock, metrics, cfg.sandbox.idle_ttl_s, self.tally
        )
        self.warmer = warmer = GpuWarmer(state, sender, {g.name for g in cfg.nodes.gpu if g.warm_up}, clock)
        self.faults = faults = Faults(
            state, books, trajectories, store, sender, self.liveness, clock, metrics
        )
        self.intake = Intake(cfg, self.view, books, trajectories, self.estimator, store, metrics)
        self.intake.on_cancel = faults.drop_cancelled
        self.intake.cap_refusal = self._cap_refusal
        declared = {n.name for n in cfg.nodes.cpu} | {g.name for g in cfg.nodes.gpu}
        self.nodes = NodeBook(state, declared, self.restore_costs, gpu_footprint(cfg))
        self.shape = CpuShape.of_config(cfg)
        self.events = Events(
            state, books, trajectories, warmer, faults, store, self.recorder, self.estimator, clock
        )
        self.dispatcher = Dispatcher(
            state,
            books,
            trajectories,
            warmer,
            sender,
            store,
            self.recorder,
            clock,
            check_invariants=cfg.scheduler.check_invariants,
        )
        fair, batch = cfg.scheduler.fair_share, {m.name: m.max_batch for m in cfg.reward_models}
        self.round = Round(
            self.policy,
            fair=FairShareSpec(fair.weights, fair.aging_s) if fair.enabled else None,
            max_batch=lambda service: batch.get(service, 1),
            gpu_services=gpu_services(cfg),
            cpu_batch=cfg.scheduler.cpu_batch.spec(),
            observed=lambda qa, units: self.estimator.observed_s(qa.kind, units),
        )

    # ---- what tests and tools read -------------------------------------------------------------
    @property
    def waiting(self) -> WaitingQueue:
        return self.books.waiting

    @property
    def metrics(self) -> SchedulerMetrics:
        return self.recorder.metrics

    @property
    def progress_s(self) -> float:
        """When actions were last dispatched or completed (`time.monotonic`)."""
        return max(self.dispatcher.progress_s, self.events.progress_s)

    # ---- lifecycle -------------------------------------------------------------------------
    def _reset(self) -> None:
        """Forget everything in memory; `start()` rebuilds it from Redis."""
        progress = self.dispatcher.progress_s, self.events.progress_s
        self._build()
        self.dispatcher.progress_s, self.events.progress_s = progress

    def start(self) -> None:
        """Connect, publish the pool view, and recover state left by a previous run."""
        self.store.ping()
        self.sync_tenants()
        self.store.ensure_groups()
        self.store.publish_config(self.view)
        self.sync_nodes()  # nodes that joined before this start: their pins and actions recover
        self.recover()

    def recover(self) -> None:
        """Rebuild state from Redis after a restart: running allocations, pins, pending entries."""
        store = self.store
        records = store.load_running()
        states = store.states(list(records))
        plan = recovery_plan(
            records,
            states,
            store.load_pins(),
            self.cfg,
            self.estimator,
            self.clock(),
            self.state.cpu,
            self.intake.shape,
        )
        self._restore(plan)
        # Sandboxes of restored pins may be gone (their workers restarted too): the liveness
        # check releases those (`TrajectoryBook.reconcile`) once the workers' reports say so.
        self.trajectories.sandboxes.restore_resets(store.load_resets())
        if plan.resend:
            log.info("re-sending %d dispatched action(s) after restart", len(plan.resend))
            share = self.round.execution.time_share
            self.sender.send(
                plan.resend, self.books, share_weight=share.weight if share is not None else None
            )
        # Unacknowledged events and intake entries of the previous run, in stream (FCFS) order.
        for page in store.read_pending(EVENTS):
            self.on_events(page)
        for stream in list(store.intakes):  # every tenant's intake
            for page in store.read_pending(stream):
                self.on_intake(page)

    def _cap_refusal(self, qa: QueuedAction) -> str | None:
        """Why a named tenant's caps can never hold `qa` (`scheduler.tenancy.refusal`)."""
        if qa.job_id not in self.intake.tenants:
            return None
        return refusal(qa, self.round.tenancy.caps.get(qa.job_id), self.state.api)

    def sync_tenants(self) -> None:
        """Read the tenant registry, once: the intakes to read (`Store.watch_tenants`), each
        tenant's record for intake, and its caps and limits (the tenant book's); and
        publish Redis's memory use for the clients' admission (`Store.publish_memory`); and keep
        the clients' scripts loaded (`Store.load_client_scripts`)."""
        records = self.store.tenants()
        self.store.watch_tenants(records)
        self.intake.tenants = records
        self.dispatcher.tenants.sync(self.round, self.books, records)  # caps, limits, gauges
        loaded = self.store.load_client_scripts()  # a restarted Redis: its cache is empty
        if loaded:
            log.info("loaded %d client script(s) into Redis's cache", len(loaded))
        self.store.publish_memory()

    def _restore(self, plan: RecoveryPlan) -> None:
        """Carry out a recovery plan on the fresh state and books."""
        self.state.restore(plan.snapshot)
        books, active = self.books, self.trajectories.active
        for got in plan.queued:
            books.admit(got.meta, got.qa, attempt=got.attempt)
            active[got.qa.trajectory_id] += 1
        books.waiting.sort_by_submission()
        for got in plan.running:
            books.restore_running(got.meta, got.qa, got.attempt, got.sandbox)
            active[got.qa.trajectory_id] += 1
            self.round.track(got.qa)
            alloc = self.state.running.get(got.qa.action_id)
            if alloc is not None:  # a running malleable action is lent cores again
                self.round.track_malleable(got.qa, alloc)
        for tid, pin in plan.pins.items():
            self.trajectories.sandboxes.restore_pin(tid, pin)

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
        next_check = next_nodes = next_tenants = 0.0
        while not self._stop.is_set():
            try:
                # API pools refill over time: wake up often while API actions wait for quota.
                # (islice: a slice of the queue would build its positional list, O(queue), each
                # time the queue changed, which is every step of a burst)
                head = itertools.islice(self.waiting, 64)
                wait_api = any(a.cost.key is ResourceKind.API for a in head)
                self.step(block_ms=20 if wait_api else idle_block_ms)
                if time.monotonic() >= next_check:
                    self.check()
                    next_check = time.monotonic() + self.liveness.check_every_s
                elif time.monotonic() >= next_nodes:  # a joining node takes work within a step
                    self._update("nodes", self._poll_nodes)
                    next_nodes = time.monotonic() + NODES_EVERY_S
                if time.monotonic() >= next_tenants:
                    self._update("tenants", self.sync_tenants)
                    next_tenants = time.monotonic() + TENANTS_EVERY_S
            except _TRANSIENT as e:
                if isinstance(e, redis.ResponseError) and not _is_oom(e):
                    raise
                # Redis restarted, failed over, or refused a write at its memory ceiling (then the
                # round may have been half applied): what Redis kept is the truth; rebuild from it.
                log.warning("lost Redis (%s); rebuilding state once it is back", e)
                self._rejoin()
        with contextlib.suppress(*_TRANSIENT):  # else they are done again after a restart
            self.store.settle()
        self.recorder.close()
        self.store.close()

    # ---- one step ----------------------------------------------------------------------------
    def step(self, block_ms: int | None = 0) -> int:
        """Process what is readable (blocking up to block_ms) and dispatch; returns #dispatched."""
        new, done = self.store.read(self.cfg.scheduler.batch_size, block_ms)
        self.on_events(done)
        self.on_intake(new)
        return self.schedule()

    def on_events(self, entries: list[IntakeEntry]) -> None:
        self.events.on_events(entries)

    def on_intake(self, entries: list[IntakeEntry]) -> None:
        self.intake.on_intake(entries)

    def schedule(self) -> int:
        self.nodes.block()  # draining nodes take nothing new (releases gave them units back)
        n = self.dispatcher.schedule(self.round)
        self.dispatched_total += n
        return n

    def check(self) -> None:
        """The periodic pass, each manager in its own `try`: liveness (carried out by `Faults`),
        the trajectories' idle sandboxes, a stall warning, metrics. A lost Redis still ends the
        pass (everything is rebuilt from Redis); any other failure is logged and the next part
        runs."""
        self._update("liveness", self._liveness)
        self._update("trajectories", lambda: self.trajectories.update(self.clock()))
        self._update("stall warning", self.warn_if_stalled)
        self._update("metrics", self._snapshot)

    @staticmethod
    def _update(what: str, update: Callable[[], object]) -> None:
        try:
            update()
        except _TRANSIENT:
            raise
        except Exception:
            log.exception("scheduler: updating the %s failed; the loop goes on", what)

    def _liveness(self) -> None:
        """One liveness pass: assess the workers' heartbeats and the owners of the running
        actions (`liveness.assess`, pure), then carry out the plan (`Faults.apply`)."""
        store, state = self.store, self.state
        server_now, workers = self.sync_nodes()
        ids = list(state.running)
        owners = store.owners(ids) if ids else []
        running = {aid: state.running[aid] for aid in ids}
        plan = assess(self.liveness, server_now, workers, running, owners, self.clock(), self.nodes.gone)
        self.faults.left = self.nodes.gone
        self.faults.apply(plan, store.sandbox_reports())
        self.faults.drained(self.nodes.drained())
        learn_images(state, store.image_reports())  # issue 36: the nodes' image stores

    def _poll_nodes(self) -> None:
        """Between liveness passes: read the nodes; one that joined takes work at once (the
        waiting actions are placed now, not after the next read blocks)."""
        before = len(self.state.cpu) + len(self.state.gpu)
        self.sync_nodes()
        if len(self.state.cpu) + len(self.state.gpu) > before and self.waiting:
            self.schedule()

    def sync_nodes(self) -> tuple[float, dict[str, tuple[float, str]]]:
        """Nodes joining, draining and leaving (`nodes.NodeBook`); returns what `Store.workers`
        read. The largest node the clients are told of grows with the nodes that join."""
        server_now, workers = self.store.workers()
        live = live_pools(server_now, workers, self.liveness.dead_after_s)
        changes = self.nodes.sync(self.store.node_records(), live)
        for key in changes.added:  # a GPU node that joins takes warm orders (`warm_up` defaults on)
            kind, _, name = key.partition(":")
            if kind == "gpu" and name not in self.nodes.declared:
                self.warmer.warm_nodes.add(name)
        if changes.shape_changed:
            shape = self.shape.widened(CpuShape.of_state(self.state))
            if shape != self.shape:
                self.shape = self.intake.shape = shape
                self.view = self.intake.view = self.view.model_copy(
                    update={"max_cpus": shape.max_group_cores, "max_memory_mb": shape.max_memory_mb}
                )
                self.store.publish_config(self.view)
        for key in changes.removed:  # a node that left: its record goes (one that came back stays)
            name = key.partition(":")[2]
            rec = self.nodes.records.get(name)
            if rec is not None and rec.state is NodeState.LEFT:
                self.store.drop_left_node(name, rec.worker)
        if changes.removed:
            self.store.publish_node_load({}, [k.partition(":")[2] for k in changes.removed])
        return server_now, workers

    def _snapshot(self) -> None:
        self.recorder.snapshot(self.waiting, self.state, self.state.offline)
        loads = self.nodes.loads(self.clock())
        self.store.publish_node_load(loads, [])
        node_gauges(self.metrics, loads, self.nodes.records)
        self.recorder.flush()

    def warn_if_stalled(self, after_s: float = 30.0) -> None:
        """Say why nothing moves when actions wait and nothing ran or ended for `after_s`."""
        now = time.monotonic()
        waiting, state, progress_s = self.waiting, self.state, self.progress_s
        if not waiting or now - progress_s < after_s or now - self._stall_logged_s < after_s:
            return
        self._stall_logged_s = now
        head = waiting[0]
        pin = state.trajectory_node.get(head.trajectory_id, "-")
        cpu = {n: (len(c.free), c.memory_free_mb) for n, c in state.cpu.items()}
        log.warning(
            "no progress for %.0f s with %d waiting: head %s (trajectory %s pinned to %s, %s %s units); "
            "cpu free (cores, MiB)=%s; offline=%s; running=%d",
            now - progress_s,
            len(waiting),
            head.action_id,
            head.trajectory_id,
            pin,
            head.cost.key,
            head.cost.units.min,
            cpu,
            sorted(state.offline),
            len(state.running),
        )
