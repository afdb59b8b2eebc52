"""Celery task registration: binds the task names of `tangram_celery.transport.app` to handlers."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

from tangram_celery.common.wire import CoreLoan, GpuWarm
from tangram_celery.transport.app import (
    TASK_API,
    TASK_CLOSE,
    TASK_CPU,
    TASK_CPU_BATCH,
    TASK_FETCH,
    TASK_GPU,
    TASK_LEND,
    TASK_NOOP,
    TASK_WARM,
)
from tangram_celery.workers.base import Handler, WorkerRuntime

log = logging.getLogger("tangram.worker")


def register(
    app: Celery,
    runtime: WorkerRuntime,
    *,
    cpu: Handler | None = None,
    api: Handler | None = None,
    gpu: Handler | None = None,
    close: Any = None,
    lend: Any = None,
    warm: Any = None,
    fetch: Any = None,
) -> None:
    """Register the tasks this worker serves; results go through the Tangram store, not Celery's."""

    @app.task(name=TASK_NOOP)
    def noop(x: Any = None) -> Any:
        return x

    for name, handler in ((TASK_CPU, cpu), (TASK_API, api), (TASK_GPU, gpu)):
        if handler is None:
            continue

        def run(action_id: str, order_msg: dict[str, Any], _h: Handler = handler) -> str:
            return runtime.execute(action_id, order_msg, _h)

        app.task(name=name, ignore_result=True, acks_late=True)(run)

    if cpu is not None:

        def run_batch(items: list[list[Any]], _h: Handler = cpu) -> list[str]:
            return runtime.execute_batch(items, _h)

        app.task(name=TASK_CPU_BATCH, ignore_result=True, acks_late=True)(run_batch)

    if fetch is not None:

        @app.task(name=TASK_FETCH, ignore_result=True)
        def fetch_image(image: str) -> None:
            fetch(str(image))  # in the background: a fetch takes no action's slot

    if close is not None:

        @app.task(name=TASK_CLOSE, ignore_result=True)
        def close_trajectory(trajectory_id: str, generation: str | None = None, keep: bool = False) -> None:
            close(trajectory_id, generation, keep)  # keep: idle past its TTL, not closed

    _control(app, TASK_LEND, lend, CoreLoan)
    _control(app, TASK_WARM, warm, GpuWarm)


def _control(app: Celery, name: str, handler: Any, model: type[CoreLoan] | type[GpuWarm]) -> None:
    """A scheduler -> worker control message (`wire.CoreLoan`, `wire.GpuWarm`): validated, then
    handed to `handler`; one that does not parse is logged and dropped."""
    if handler is None:
        return

    @app.task(name=name, ignore_result=True)
    def control(order: dict[str, Any]) -> None:
        try:
            msg = model.model_validate(order)
        except ValueError as e:
            log.error("%s: unreadable order, dropped: %s", name, e)
            return
        handler(msg)
