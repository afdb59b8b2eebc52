"""The Celery application: JSON only, late acks, prefetch 1, reject on worker lost.

Queue names: `tangram.cpu.<node>`, `tangram.gpu.<node>`, `tangram.api.<name>`. Task names are
constants here so that the scheduler can `send_task` without importing worker code.
"""

from __future__ import annotations

from celery import Celery

from tangram_celery.transport.kombu_redis import guard_connparams, reuse_channel_client
from tangram_celery.transport.tls import ssl_options

TASK_CPU = "tangram.run_cpu"
TASK_CPU_BATCH = "tangram.run_cpu_batch"  # [[action id, order], ...]: run one after another
TASK_GPU = "tangram.run_gpu"
TASK_API = "tangram.run_api"
TASK_CLOSE = "tangram.close_trajectory"
TASK_NOOP = "tangram.noop"  # plain-Celery baseline for benchmarks
TASK_LEND = "tangram.lend_cores"  # wire.CoreLoan, on a CPU node's queue
TASK_WARM = "tangram.warm_gpu"  # wire.GpuWarm, on a GPU node's queue
TASK_FETCH = "tangram.fetch_image"  # [image]: bring an image into a CPU node's store, ahead


def queue_name(kind: str, pool: str) -> str:
    """The Celery queue for a pool: kind is 'cpu', 'gpu' or 'api'."""
    return f"tangram.{kind}.{pool}"


def make_app(broker_url: str, *, visibility_timeout_s: int = 3600) -> Celery:
    """A Celery app bound to `broker_url` (Redis, or TLS to Redis: `transport.tls`), used as
    broker and result backend.

    `memory://` (kombu's in-process transport, for tests) gets an in-memory result backend."""
    backend = "cache+memory://" if broker_url.startswith("memory://") else broker_url
    guard_connparams()  # a Redis restart must not stop a worker (see kombu_redis)
    reuse_channel_client()  # no new redis.Redis per message kombu publishes (see kombu_redis)
    app = Celery("tangram", broker=broker_url, backend=backend, set_as_current=False)
    # kombu and the result backend read a rediss:// URL's ssl_* query themselves; the dict is
    # for what reads only the settings (Flower's broker page)
    tls = ssl_options(broker_url)
    if tls is not None:
        app.conf.update(broker_use_ssl=tls, redis_backend_use_ssl=tls)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue="tangram.default",
        task_track_started=False,
        result_expires=24 * 3600,
        result_extended=False,
        worker_send_task_events=True,
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": visibility_timeout_s},
        result_backend_transport_options={"retry_policy": {"timeout": 5.0}},
        broker_pool_limit=16,
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
    return app
