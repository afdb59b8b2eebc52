"""Start a worker process for one pool: `tangram worker cpu --node N` / `api --name A` / `gpu`."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from typing import Literal

from celery import Celery

from tangram_celery.common.config import CpuNodeConfig, SandboxConfig, TangramConfig
from tangram_celery.common.errors import ConfigError
from tangram_celery.common.metrics import serve
from tangram_celery.transport.app import make_app, queue_name
from tangram_celery.transport.broker import resolve_url
from tangram_celery.workers import tasks
from tangram_celery.workers.base import WorkerRuntime
from tangram_celery.workers.capacity import Caps

log = logging.getLogger("tangram.worker")


def quiet_task_lines() -> None:
    """Celery logs two INFO lines per task (received, succeeded): at a hundred actions a
    second, a gigabyte a day per worker. Each action is in the scheduler's run log
    (`actions.jsonl`) and each task in Flower; failures still log (at WARNING and above)."""
    from celery.signals import after_setup_logger

    def quiet(**_: object) -> None:
        for name in ("celery.app.trace", "celery.worker.strategy"):
            logging.getLogger(name).setLevel(logging.WARNING)

    after_setup_logger.connect(quiet, weak=False)
    quiet()


def ready_for_batches(cfg: TangramConfig, node: CpuNodeConfig) -> SandboxConfig:
    """The node's sandbox settings: enough scrubbed sandboxes kept ready for a batch of new
    trajectories on every core (`scheduler.cpu_batch`) unless `sandbox.ready_max` says; and, unless
    `sandbox.ready_idle` says, as many started ahead while the worker is idle, at most as many as
    the node's sandbox memory holds trajectories at the default memory: the first burst of new
    trajectories after a start (before any sandbox can be recycled) then starts none itself."""
    from tangram_celery.sandbox.prewarm import kept_ready  # here: API and GPU workers need no sandbox

    box, batch = cfg.sandbox, cfg.scheduler.cpu_batch
    update: dict[str, int] = {}
    if box.ready_max is None and batch.enabled:
        update["ready_max"] = node.cores * batch.max_actions
    if box.ready_idle is None:  # what its pool keeps ready (`kept_ready`), at most what memory holds
        keep = kept_ready(box.prewarm, update.get("ready_max", box.ready_max))
        update["ready_idle"] = min(keep, node.memory_mb // box.default_memory_mb)
    return box.model_copy(update=update)


def sharers_per_core(cfg: TangramConfig) -> int:
    """How many time sharers the scheduler may run on one core beside its holder (0 when its
    policy never shares, `scheduler.time_share`)."""
    spec = cfg.scheduler.make_policy().execution.time_share
    return spec.per_core if spec is not None else 0


# How long a CPU worker's thread keeps the GIL while another waits for it (CPython: 5 ms).
CPU_SWITCH_S = 0.0005


def run_worker(
    cfg: TangramConfig,
    kind: Literal["cpu", "api", "gpu"],
    name: str | None,
    *,
    loglevel: str = "INFO",
    concurrency: int | None = None,
    metrics_port: int = 0,
    metrics_addr: str = "127.0.0.1",
    task_events: bool = True,
    caps: Caps | None = None,
) -> None:
    """Block serving the pool's queue until the worker is stopped (SIGTERM / Ctrl-C).

    A CPU/GPU worker serves node `name` (None: `$TANGRAM_NODE`, else the host name), declared
    in the config or not, with the capacity it detects, its config entry and the operator's
    `caps` say (`workers.membership`); it registers the node, and drains it on SIGTERM.

    `task_events`: send Celery's task events (what Flower shows) from the start. Without them
    a monitor still turns them on (`celery control enable_events`, which Flower sends every few
    seconds); until then the worker publishes nothing per task."""
    from tangram_celery.workers.membership import Membership, node_name, resolve_cpu, resolve_gpu

    record = None
    if kind != "api":
        name = node_name(name)
        resolve = resolve_cpu if kind == "cpu" else resolve_gpu
        try:
            cfg, record = resolve(cfg, name, caps or Caps())
        except ValueError as e:
            raise ConfigError(str(e)) from e
    elif not name:
        raise ConfigError("an API worker needs --name (one of apis)")
    url = resolve_url(cfg)
    app = make_app(url)
    app.conf.worker_send_task_events = task_events  # what `-E` would set: one switch, not two
    runtime = WorkerRuntime(url, kind, name)
    closing: list[Callable[[], None]] = []
    serve_pool = {"cpu": _serve_cpu, "api": _serve_api, "gpu": _serve_gpu}[kind]
    needed = serve_pool(cfg, name, app, runtime, closing)  # registers its tasks first
    slots = concurrency or needed
    runtime.start(app)
    member = Membership(runtime.store, record, runtime.name) if record is not None else None
    if member is not None:
        member.join(runtime.languages)
        member.hook()
    quiet_task_lines()
    serve(runtime.metrics.registry, metrics_port, metrics_addr)
    log.info("worker %s serving %s with %d slots", runtime.name, queue_name(kind, name), slots)
    try:
        app.worker_main(celery_argv(queue_name(kind, name), runtime.name, slots, loglevel))
    finally:
        if member is not None:  # its running actions are done: the node has left
            runtime.stop()
            member.leave()
            with contextlib.suppress(Exception):  # Redis gone first: liveness forgets it later
                runtime.store.forget_worker(runtime.name)
        for close in closing:  # sandboxes and their cgroups go with a clean shutdown
            close()


def celery_argv(queue: str, worker: str, slots: int, loglevel: str) -> list[str]:
    """The Celery worker's command line: one queue, `slots` threads, one message at a time each."""
    return [
        "worker",
        "-Q",
        queue,
        "-n",
        worker,
        "-P",
        "threads",
        "-c",
        str(slots),
        "--prefetch-multiplier=1",
        "--without-mingle",
        "--without-gossip",
        f"--loglevel={loglevel}",
    ]


def _serve_cpu(
    cfg: TangramConfig, name: str, app: Celery, runtime: WorkerRuntime, closing: list[Callable[[], None]]
) -> int:
    """Register CPU node `name`'s tasks on its sandboxes; returns the slots it needs."""
    # The worker's threads (a batch per core set, sandbox closes, the Celery consumer) take
    # turns on the GIL, and a thread whose runner has answered waits for it while its core
    # idles. CPython hands the GIL over after 5 ms by default, as long as a whole short
    # action; with CPU_SWITCH_S the stateless HumanEval run took less wall and CPU time.
    sys.setswitchinterval(CPU_SWITCH_S)
    node = next(n for n in cfg.nodes.cpu if n.name == name)  # declared by `resolve_cpu`
    from tangram_celery.sandbox import SandboxScope, open_sandbox
    from tangram_celery.sandbox.egress import deployment_hosts
    from tangram_celery.workers.cpu import CpuHandler

    rules = {m.name: str(m.rule) for m in cfg.reward_models if m.backend == "rule"}
    # the scope (state dir + node) lets this worker remove what a previous one of the same
    # node left before it serves; nobody else's sandboxes are touched
    sandbox = open_sandbox(
        ready_for_batches(cfg, node), SandboxScope.of_node(cfg.state_dir, name), deployment_hosts(cfg)
    )
    closing.append(sandbox.close)
    handler = CpuHandler(sandbox, cfg.sandbox, rules)
    # what this node's sandboxes run: clients refuse actions in anything else at submit
    runtime.store.set_languages(name, handler.languages)
    runtime.languages = list(handler.languages)
    tasks.register(
        app, runtime, cpu=handler, close=handler.close_trajectory, lend=handler.lend, fetch=handler.prefetch
    )
    runtime.held = handler.held  # reported next to the heartbeats
    runtime.closer = handler.evict_trajectory  # evictions carried by the task orders
    runtime.images = handler.images_report  # reported next to the heartbeats
    runtime.batch_hand_back_s = cfg.scheduler.cpu_batch.hand_back_after_ms / 1000
    # One thread per core for the actions (the scheduler never sends more than the node's
    # cores can run: a batch of riders is one message), one more per core for the next
    # batch sent for those cores while the last actions of one run there (it waits for its
    # turn: `cpu_batch.join_below`), as many more as time sharers may run beside them
    # (`per_core` per core), and two more so that sandbox closes (evictions) are taken
    # while every core is busy: their sandboxes are scrubbed and ready for the next new
    # trajectories instead of waiting behind the running batches.
    batch = cfg.scheduler.cpu_batch.spec()
    queued = 1 if batch is not None and batch.joins else 0
    return node.cores * (1 + queued + sharers_per_core(cfg)) + 2


def _serve_api(
    cfg: TangramConfig, name: str, app: Celery, runtime: WorkerRuntime, closing: list[Callable[[], None]]
) -> int:
    """Register API `name`'s task; returns the slots it needs."""
    api = cfg.api(name)
    if api is None:
        raise ConfigError(f"no API named {name!r} in apis ({[a.name for a in cfg.apis]})")
    from tangram_celery.workers.api import ApiHandler

    tasks.register(app, runtime, api=ApiHandler(api))
    return min(64, api.max_concurrency or 16)


def _serve_gpu(
    cfg: TangramConfig, name: str, app: Celery, runtime: WorkerRuntime, closing: list[Callable[[], None]]
) -> int:
    """Register GPU node `name`'s tasks on its reward service; returns the slots it needs."""
    gnode = next(n for n in cfg.nodes.gpu if n.name == name)  # declared by `resolve_gpu`
    from tangram_celery.workers.gpu import GpuHandler

    handler = GpuHandler(cfg, gnode, runtime.metrics, runtime.store, warm=gnode.warm_up)
    # tritonserver and its Python stubs (one process per loaded replica) go with a clean
    # shutdown; left to PDEATHSIG, the stubs outlived the server by seconds
    closing.append(handler.close)
    tasks.register(app, runtime, gpu=handler, warm=handler.warm)
    # Each chunk runs one batch at a time, of up to max_batch actions (one thread each).
    most = max((m.max_batch for m in cfg.reward_models if m.backend != "rule"), default=1)  # rules: CPU
    return min(256, gnode.num_gpus * most)
