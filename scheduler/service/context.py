"""What the scheduler service's parts share: the state, the books, and the two outputs (the store
and the Celery messages). The handlers in `intake`, `events`, `dispatch`, `faults` and
`trajectories` are functions of a `Context`; the loop owns one and calls them."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from celery import Celery

from scheduler.estimator import DurationEstimator
from scheduler.model import Allocation, ResourceKind
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState
from scheduler.service.books import Books
from scheduler.service.liveness import LivenessPolicy
from scheduler.service.record import RunRecorder
from tangram_celery.app import TASK_API, TASK_CLOSE, TASK_CPU, TASK_GPU, queue_name
from tangram_celery.config import TangramConfig
from tangram_celery.metrics import SchedulerMetrics
from tangram_celery.store import Store
from tangram_celery.wire import TaskOrder

_TASKS = {ResourceKind.CPU: TASK_CPU, ResourceKind.GPU: TASK_GPU, ResourceKind.API: TASK_API}


class Sender:
    """The Celery side: one message per dispatched action, and sandbox close requests."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    def send(self, allocs: Iterable[Allocation], books: Books) -> None:
        """Publish one message per allocation, pipelined into one Redis round trip.

        Results flow through the Tangram store, so Celery's result backend is not involved
        (ignore_result). The arguments' repr, which Flower shows and searches, names the
        action's kind and trajectory. `batch` counts the actions sent together on the same pool
        (on a GPU node: the same chunk, i.e. one batch of reward requests)."""
        allocs = list(allocs)
        batch = Counter(_batch_key(a) for a in allocs)
        with self.app.producer_or_acquire() as producer, producer.batch(max_size=1000):
            for alloc in allocs:
                aid = alloc.action_id
                qa = books.running.get(aid)
                what = f"kind={qa.kind}, trajectory={qa.trajectory_id}, " if qa is not None else ""
                order = TaskOrder(
                    action_id=aid,
                    kind=alloc.kind.value,
                    pool=alloc.pool,
                    units=alloc.units,
                    unit_ids=alloc.unit_ids,
                    evict=alloc.evict,
                    attempt=books.attempt[aid],
                    batch=batch[_batch_key(alloc)],
                    sandbox=books.sandbox_of.get(aid),
                )
                self.app.send_task(
                    _TASKS[alloc.kind],
                    args=[aid, order.model_dump(mode="json", exclude_none=True)],
                    task_id=aid,
                    queue=queue_name(alloc.kind.value, alloc.pool),
                    producer=producer,
                    ignore_result=True,
                    argsrepr=f"[{aid!r}, {what}units={alloc.units}]",
                    kwargsrepr="{}",
                )

    def close(self, node: str, tid: str, gen: str) -> None:
        """Have the worker of CPU `node` remove `tid`'s sandbox of generation `gen` (only that
        one: a newer sandbox of the same trajectory, started since, is kept)."""
        self.app.send_task(TASK_CLOSE, args=[tid, gen], queue=queue_name("cpu", node))


def _batch_key(alloc: Allocation) -> tuple[str, str, tuple[int, ...]]:
    """Actions with one key were sent as one batch: same pool, and on a GPU node the same chunk."""
    return str(alloc.kind), alloc.pool, alloc.unit_ids if alloc.kind is ResourceKind.GPU else ()


@dataclass
class Context:
    """The scheduler's live state and its outputs."""

    cfg: TangramConfig
    store: Store
    sender: Sender
    recorder: RunRecorder
    estimator: DurationEstimator
    clock: Callable[[], float]
    liveness: LivenessPolicy
    state: ClusterState
    waiting: WaitingQueue = field(default_factory=WaitingQueue)  # FCFS, indexed (scheduler/queue.py)
    books: Books = field(default_factory=Books)
    progress_s: float = field(default_factory=time.monotonic)  # last dispatch or completion
    dispatched_total: int = 0

    @property
    def metrics(self) -> SchedulerMetrics:
        return self.recorder.metrics
