"""SchedulerService: the control loop around one scheduling round.

Each step: read intake + completion events (one blocking XREADGROUP over both streams) ->
release finished units (`events`) -> admit new actions into the FCFS waiting queue (`intake`)
-> one round (`scheduler.round.Round`, the simulator's round too) -> persist the dispatch
records, acknowledge the intake entries and send the Celery messages (`dispatch`). Every
`check_every_s`: a liveness pass (`liveness.assess`, carried out by `faults.apply`), idle
sandboxes expired, metrics refreshed.

The parts are functions of a shared `Context` (state, books, store, sender); this class owns
one, and wires the parts in the order above. Managers decide, the loop applies: liveness and
recovery return plans, the round returns a plan, and only the loop calls what carries them out.
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
from scheduler.model import ResourceKind
from scheduler.policies import Policy
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState
from scheduler.round import FairShareSpec, Round
from scheduler.service import dispatch, events, faults, intake, liveness, recovery, trajectories
from scheduler.service.books import Books
from scheduler.service.cluster import build_cluster
from scheduler.service.context import Context, Sender
from scheduler.service.record import RunRecorder
from tangram_celery.common.config import TangramConfig
from tangram_celery.common.errors import BrokerError
from tangram_celery.common.metrics import SchedulerMetrics
from tangram_celery.common.wire import PoolView
from tangram_celery.store import EVENTS, INTAKE, IntakeEntry, Store
from tangram_celery.transport.app import make_app

log = logging.getLogger("tangram.scheduler")

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
    twins (`tangram_celery.testing`)."""

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
    ) -> None:
        self.cfg = cfg
        self.view = PoolView.of(cfg)
        self.policy = policy or cfg.scheduler.make_policy()
        fair = cfg.scheduler.fair_share
        batch = {m.name: m.max_batch for m in cfg.reward_models}
        priors = {k: {"t1_s": v.t1_s, "p": v.parallel_fraction} for k, v in cfg.scheduler.priors.items()}
        estimator = DurationEstimator.from_config(priors)
        self.round = Round(
            self.policy,
            fair=FairShareSpec(fair.weights, fair.aging_s) if fair.enabled else None,
            max_batch=lambda service: batch.get(service, 1),
            gpu_services=gpu_services(cfg),
            cpu_batch=cfg.scheduler.cpu_batch.spec(),
            observed=lambda qa, units: self.ctx.estimator.observed_s(qa.kind, units),
        )
        self.ctx = Context(
            cfg=cfg,
            store=store or Store(broker_url),
            sender=Sender(app or make_app(broker_url)),
            recorder=RunRecorder(
                Path(cfg.state_dir) / "actions.jsonl" if record else None,
                max_bytes=cfg.scheduler.run_log_max_mb << 20,
                keep=cfg.scheduler.run_log_keep,
            ),
            estimator=estimator,
            clock=clock,
            liveness=liveness.LivenessPolicy(),
            state=build_cluster(cfg),
        )
        self._stall_logged_s = 0.0
        self._evictions_logged_s = float("-inf")  # the first evictions are told at once
        self._stop = threading.Event()

    # ---- what tests and tools read -------------------------------------------------------------
    @property
    def store(self) -> Store:
        return self.ctx.store

    @property
    def state(self) -> ClusterState:
        return self.ctx.state

    @property
    def waiting(self) -> WaitingQueue:
        return self.ctx.waiting

    @property
    def books(self) -> Books:
        return self.ctx.books

    @property
    def dispatched_total(self) -> int:
        return self.ctx.dispatched_total

    @property
    def metrics(self) -> SchedulerMetrics:
        return self.ctx.metrics

    # ---- lifecycle -------------------------------------------------------------------------
    def _reset(self) -> None:
        """Forget everything in memory; `start()` rebuilds it from Redis."""
        ctx = self.ctx
        ctx.state = build_cluster(self.cfg)
        ctx.waiting = WaitingQueue()
        ctx.books = Books()
        old = self.round
        self.round = Round(
            self.policy,
            fair=old.fair,
            max_batch=old.max_batch,
            gpu_services=gpu_services(self.cfg),
            cpu_batch=old.cpu_batch,
            observed=old.observed,
        )

    def start(self) -> None:
        """Connect, publish the pool view, and recover state left by a previous run."""
        self.store.ping()
        self.store.ensure_groups()
        self.store.publish_config(self.view)
        self.recover()

    def recover(self) -> None:
        """Rebuild state from Redis after a restart: running allocations, pins, pending entries."""
        ctx, store = self.ctx, self.store
        records = store.load_running()
        states = store.states(list(records))
        plan = recovery.plan(
            records, states, store.load_pins(), self.cfg, ctx.estimator, ctx.clock(), ctx.state.cpu
        )
        ctx.state.restore(plan.snapshot)
        books = ctx.books
        for got in plan.queued + plan.running:
            aid = got.qa.action_id
            books.meta[aid] = got.meta
            books.attempt[aid] = got.attempt
            books.active[got.qa.trajectory_id] += 1
        for got in plan.queued:
            ctx.waiting.append(got.qa)
        ctx.waiting.sort_by_submission()
        for got in plan.running:
            books.running[got.qa.action_id] = got.qa
            if got.sandbox is not None:
                books.sandbox_of[got.qa.action_id] = got.sandbox
            self.round.track(got.qa)
            alloc = ctx.state.running.get(got.qa.action_id)
            if alloc is not None:  # a running malleable action is lent cores again
                self.round.track_malleable(got.qa, alloc)
        for tid, pin in plan.pins.items():
            books.sandboxes.restore_pin(tid, pin)
        # Sandboxes of restored pins may be gone (their workers restarted too): the liveness
        # check releases those (`trajectories.reconcile`) once the workers' reports say so.
        books.sandboxes.restore_resets(store.load_resets())
        if plan.resend:
            log.info("re-sending %d dispatched action(s) after restart", len(plan.resend))
            share = self.round.execution.time_share
            ctx.sender.send(plan.resend, books, share_weight=share.weight if share is not None else None)
        # Unacknowledged events and intake entries of the previous run, in stream (FCFS) order.
        for page in store.read_pending(EVENTS):
            self.on_events(page)
        for page in store.read_pending(INTAKE):
            self.on_intake(page)

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
                # (islice: a slice of the queue would build its positional list, O(queue), each
                # time the queue changed, which is every step of a burst)
                head = itertools.islice(self.waiting, 64)
                wait_api = any(a.cost.key is ResourceKind.API for a in head)
                self.step(block_ms=20 if wait_api else idle_block_ms)
                if time.monotonic() >= next_check:
                    self.check()
                    next_check = time.monotonic() + self.ctx.liveness.check_every_s
            except _TRANSIENT as e:
                if isinstance(e, redis.ResponseError) and not _is_oom(e):
                    raise
                # Redis restarted, failed over, or refused a write at its memory ceiling (then the
                # round may have been half applied): what Redis kept is the truth; rebuild from it.
                log.warning("lost Redis (%s); rebuilding state once it is back", e)
                self._rejoin()
        with contextlib.suppress(*_TRANSIENT):  # else they are done again after a restart
            self.store.settle()
        self.ctx.recorder.close()
        self.store.close()

    # ---- one step ----------------------------------------------------------------------------
    def step(self, block_ms: int | None = 0) -> int:
        """Process what is readable (blocking up to block_ms) and dispatch; returns #dispatched."""
        new, done = self.store.read(self.cfg.scheduler.batch_size, block_ms)
        self.on_events(done)
        self.on_intake(new)
        return self.schedule()

    def on_events(self, entries: list[IntakeEntry]) -> None:
        events.on_events(self.ctx, entries)

    def on_intake(self, entries: list[IntakeEntry]) -> None:
        intake.on_intake(self.ctx, self.view, entries)

    def schedule(self) -> int:
        return dispatch.schedule(self.ctx, self.round)

    def check(self) -> None:
        """The periodic pass: liveness, idle sandboxes, a stall warning, metrics."""
        ctx, store = self.ctx, self.store
        server_now, workers = store.workers()
        ids = list(ctx.state.running)
        owners = store.owners(ids) if ids else []
        running = {aid: ctx.state.running[aid] for aid in ids}
        plan = liveness.assess(ctx.liveness, server_now, workers, running, owners, ctx.clock())
        faults.apply(ctx, plan, store.sandbox_reports())
        trajectories.expire_idle(ctx, ctx.clock())
        self.log_evictions()
        self.warn_if_stalled()
        ctx.recorder.snapshot(ctx.waiting, ctx.state, ctx.state.offline)
        ctx.recorder.flush()

    def log_evictions(self, every_s: float = 30.0) -> None:
        """One line per `every_s` for the idle trajectories evicted meanwhile (one line per
        eviction, at DEBUG: a stateless caller evicts one per action)."""
        now = time.monotonic()
        if self.ctx.evicted_since_log and now - self._evictions_logged_s >= every_s:
            log.info(
                "evicted %d idle trajector%s to make room (memory is a cache; at most one such line per %.0f s)",
                self.ctx.evicted_since_log,
                "y" if self.ctx.evicted_since_log == 1 else "ies",
                every_s,
            )
            self.ctx.evicted_since_log = 0
            self._evictions_logged_s = now

    def warn_if_stalled(self, after_s: float = 30.0) -> None:
        """Say why nothing moves when actions wait and nothing ran or ended for `after_s`."""
        now = time.monotonic()
        ctx = self.ctx
        if not ctx.waiting or now - ctx.progress_s < after_s or now - self._stall_logged_s < after_s:
            return
        self._stall_logged_s = now
        head = ctx.waiting[0]
        pin = ctx.state.trajectory_node.get(head.trajectory_id, "-")
        cpu = {n: (len(c.free), c.memory_free_mb) for n, c in ctx.state.cpu.items()}
        log.warning(
            "no progress for %.0f s with %d waiting: head %s (trajectory %s pinned to %s, %s %s units); "
            "cpu free (cores, MiB)=%s; offline=%s; running=%d",
            now - ctx.progress_s,
            len(ctx.waiting),
            head.action_id,
            head.trajectory_id,
            pin,
            head.cost.key,
            head.cost.units.min,
            cpu,
            sorted(ctx.state.offline),
            len(ctx.state.running),
        )
