"""The scheduler's Celery side: every message it sends to workers (actions, sandbox closes, core
loans, warm GPU orders) goes through one `Sender`. It decides nothing; the managers tell it what
to send."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from celery import Celery

from scheduler.images import ImageFetch
from scheduler.model import Allocation, ResourceKind
from scheduler.service.books import ActionBook
from scheduler.service.cluster import alloc_to_wire
from tangram_celery.common.metrics import SchedulerMetrics
from tangram_celery.common.wire import CoreLoan, GpuWarm, TaskOrder
from tangram_celery.transport.app import (
    TASK_API,
    TASK_CLOSE,
    TASK_CPU,
    TASK_CPU_BATCH,
    TASK_FETCH,
    TASK_GPU,
    TASK_LEND,
    TASK_WARM,
    queue_name,
)

_TASKS = {ResourceKind.CPU: TASK_CPU, ResourceKind.GPU: TASK_GPU, ResourceKind.API: TASK_API}


_last_seq = 0


def next_seq() -> int:
    """The next order number (core loans, warm orders): microseconds since the epoch (and more
    than the last), so a restarted scheduler's orders are newer than its predecessor's."""
    global _last_seq
    _last_seq = max(_last_seq + 1, time.time_ns() // 1000)
    return _last_seq


class Sender:
    """The Celery side: one message per dispatched action, sandbox close requests, core loans
    and warm GPU orders."""

    def __init__(self, app: Celery, metrics: SchedulerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    def send(
        self,
        allocs: Iterable[Allocation],
        books: ActionBook,
        closes: Iterable[tuple[str, str, str]] = (),
        share_weight: float | None = None,
    ) -> None:
        """Publish the allocations' messages, pipelined into one Redis round trip.

        One message per action, except that CPU actions sent together on the same cores (an
        allocation and its riders, `scheduler.policies.cpu_batch`) go as one batch message, in
        order: the worker runs them one after another. Results flow through the Tangram
        store, so Celery's result backend is not involved (ignore_result). The arguments'
        repr, which Flower shows and searches, names the actions' kind and trajectory. `batch`
        counts the actions sent together on the same pool (on a GPU node: the same chunk,
        i.e. one batch of reward requests; on a CPU node: the same cores).

        `closes` (node, trajectory, generation): sandboxes of evicted trajectories, carried by
        the first message to their node (`TaskOrder.closes`), or sent as close messages when
        no action goes there. A time sharer (`Allocation.shares`) goes on its own, its sandbox
        at `share_weight` times the default CPU weight (the policy's `TimeShareSpec.weight`)."""
        groups: dict[tuple[str, str, tuple[int, ...]], list[Allocation]] = {}
        for alloc in allocs:
            groups.setdefault(_batch_key(alloc), []).append(alloc)
        pending: dict[str, list[tuple[str, str]]] = {}
        for node, tid, gen in closes:
            pending.setdefault(node, []).append((tid, gen))
        with self.app.producer_or_acquire() as producer, producer.batch(max_size=1000):
            for key, group in groups.items():
                orders = [self._order(a, books, len(group), share_weight) for a in group]
                if key[0] == ResourceKind.CPU.value and key[1] in pending:
                    orders[0] = orders[0].model_copy(update={"closes": tuple(pending.pop(key[1]))})
                if key[0] == ResourceKind.CPU.value and len(group) > 1:
                    self._publish(
                        TASK_CPU_BATCH, [[[o.action_id, _dump(o)] for o in orders]], group, books, producer
                    )
                    continue
                for alloc, order in zip(group, orders, strict=True):
                    self._publish(
                        _TASKS[alloc.kind], [alloc.action_id, _dump(order)], [alloc], books, producer
                    )
        self.close_many((node, tid, gen) for node, left in pending.items() for tid, gen in left)

    @staticmethod
    def _order(alloc: Allocation, books: ActionBook, batch: int, share_weight: float | None) -> TaskOrder:
        """The worker's order: the allocation as on the wire, and what this sending adds."""
        t = books.get(alloc.action_id)
        assert t is not None
        return TaskOrder(
            **dict(alloc_to_wire(alloc)),
            attempt=t.attempt,
            batch=batch,
            sandbox=t.sandbox,
            cpu_weight=share_weight if alloc.shares else None,
        )

    def _publish(
        self, task: str, args: list[Any], allocs: list[Allocation], books: ActionBook, producer: Any
    ) -> None:
        lead = allocs[0]
        described = []
        for a in allocs:
            qa = books.running(a.action_id)
            what = f"kind={qa.kind}, trajectory={qa.trajectory_id}, " if qa is not None else ""
            described.append(f"{a.action_id!r}, {what}units={a.units}")
        self.app.send_task(
            task,
            args=args,
            task_id=lead.action_id,
            queue=queue_name(lead.kind.value, lead.pool),
            producer=producer,
            ignore_result=True,
            argsrepr="[" + "; ".join(described) + "]",
            kwargsrepr="{}",
        )

    def close(self, node: str, tid: str, gen: str, keep: bool = False) -> None:
        """Have the worker of CPU `node` remove `tid`'s sandbox of generation `gen` (only that
        one: a newer sandbox of the same trajectory, started since, is kept); `keep`: the
        caller may come back (idle past its TTL): an image's files are kept."""
        self.close_many([(node, tid, gen)], keep)

    def close_many(self, closes: Iterable[tuple[str, str, str]], keep: bool = False) -> None:
        """`close` for each (node, trajectory, generation), pipelined into one round trip."""
        closes = list(closes)
        if not closes:
            return
        with self.app.producer_or_acquire() as producer, producer.batch(max_size=1000):
            for node, tid, gen in closes:
                self.app.send_task(
                    TASK_CLOSE,
                    args=[tid, gen, keep] if keep else [tid, gen],
                    queue=queue_name("cpu", node),
                    producer=producer,
                    ignore_result=True,
                )

    def fetch(self, fetches: Iterable[ImageFetch]) -> None:
        """Have each fetch's CPU node bring its image into its store ahead of the trajectories
        queued for it (`scheduler.round.fetch`), pipelined into one round trip."""
        fetches = list(fetches)
        if not fetches:
            return
        with self.app.producer_or_acquire() as producer, producer.batch(max_size=1000):
            for f in fetches:
                self.app.send_task(
                    TASK_FETCH,
                    args=[f.image],
                    queue=queue_name("cpu", f.node),
                    producer=producer,
                    ignore_result=True,
                )

    def lend(self, lends: Mapping[str, tuple[str, Iterable[int]]]) -> None:
        """Send each changed core loan (borrower -> (node, every core lent to it now)) to the
        borrower's CPU worker (`next_seq` numbers them), pipelined into one round trip."""
        if not lends:
            return
        app = self.app
        with app.producer_or_acquire() as producer, producer.batch(max_size=1000):
            for aid, (node, ids) in lends.items():
                loan = CoreLoan(action_id=aid, pool=node, cores=tuple(sorted(ids)), seq=next_seq())
                app.send_task(
                    TASK_LEND,
                    args=[loan.model_dump(mode="json")],
                    queue=queue_name("cpu", node),
                    producer=producer,
                    ignore_result=True,
                    argsrepr=f"[{aid!r}, cores={list(loan.cores)}]",
                )
                self.metrics.loans.labels(pool=f"cpu:{node}").inc()

    def warm(self, order: GpuWarm) -> None:
        """Send a warm restore or retirement to its GPU node's worker."""
        self.app.send_task(
            TASK_WARM,
            args=[order.model_dump(mode="json")],
            queue=queue_name("gpu", order.pool),
            ignore_result=True,
            argsrepr=f"[{order.op} {order.service} on {list(order.chunk)}]",
        )
        self.metrics.warm_orders.labels(op=order.op).inc()


def _batch_key(alloc: Allocation) -> tuple[str, str, tuple[int, ...]]:
    """Actions with one key were sent as one batch: same pool, and the same GPU chunk or the
    same CPU cores (one allocation and its riders; other CPU actions each have cores of their
    own, a time sharer's a key of its own); API calls of a pool count as one batch."""
    if alloc.shares:
        return f"{alloc.kind}:shares:{alloc.action_id}", alloc.pool, alloc.unit_ids
    return str(alloc.kind), alloc.pool, alloc.unit_ids


def _dump(order: TaskOrder) -> dict[str, Any]:
    return order.model_dump(mode="json", exclude_none=True)
