"""The live executor of the round's elastic steps: core loans and warm GPU placements.

The round decides them (`scheduler.round`: `RoundPlan.lends`, `RoundPlan.warm`, `Round.retire`),
the same for the simulator and the live service; here the live scheduler carries them out:

- **Core loans.** Each changed loan goes to the borrower's CPU worker as a `wire.CoreLoan`
  (every core lent to it now, numbered by a `seq` that grows across scheduler restarts) on the
  node's queue. The worker widens or narrows the running suite's cpuset and quota and tells its
  runner the new DoP (`tangram_celery.workers.loans`, `tangram_celery.sandbox.resize`). A lent
  core stays free in the `ClusterState`, so nothing here changes the state; a worker that
  starts an action on a lent core takes it back itself before the action runs, whatever order
  the take-back and the action arrive in. Loans end with their borrower.
- **Warm placements.** A warm restore (`GpuLoad`) makes its service resident in the state's
  view at once, as the simulator does, and goes to the GPU node's worker as a `wire.GpuWarm`;
  the worker loads the replica in free memory and answers with a `ResidencyReport` naming the
  order. Until that answer, the restore holds its chunk in the state's view of residency: a
  node's report that does not list it yet (a completion sent while it loads) does not undo it,
  and a call of the service placed there meanwhile waits at the worker for the load. Instances
  the load outgrew (`Round.retire`) are unloaded the same way (`op="unload"`).
- **Idle rounds.** With nothing waiting, the round's steps that need no waiting action still
  run (`Round.idle`), so cores that come back are lent and services placed when GPUs go idle.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from scheduler.gpu_cache import Chunk, GpuLoad
from scheduler.service.books import Warming
from tangram_celery.common.wire import CoreLoan, GpuWarm
from tangram_celery.transport.app import TASK_LEND, TASK_WARM, queue_name

if TYPE_CHECKING:
    from scheduler.round import Round, RoundPlan
    from scheduler.service.context import Context

log = logging.getLogger("tangram.scheduler")

WARM_TIMEOUT_S = 300.0  # a warm order never answered (its worker gone) stops holding its chunk
WARM_RETRY_S = 60.0  # a warm order that failed is not sent again for that chunk for this long


_last_seq = 0


def next_seq() -> int:
    """The next order number: microseconds since the epoch (and more than the last), so a
    restarted scheduler's orders are newer than its predecessor's."""
    global _last_seq
    _last_seq = max(_last_seq + 1, time.time_ns() // 1000)
    return _last_seq


def _warms(ctx: Context, node: str) -> bool:
    """Does GPU `node` take loads ahead of requests (its `warm_up`; false: each service loads
    on its first request)?"""
    return any(g.name == node and g.warm_up for g in ctx.cfg.nodes.gpu)


def retire(ctx: Context, rnd: Round, now_s: float) -> None:
    """Unload the warm instances the load outgrew (before the round decides, as the simulator)."""
    for node, chunk, service in rnd.retire(ctx.state, now_s):
        if not _warms(ctx, node) or _failed_lately(ctx, (node, chunk, service)):
            continue
        ctx.state.gpu_cache[node].unload(chunk, service)
        _send_warm(ctx, GpuWarm(op="unload", pool=node, chunk=chunk, service=service, seq=next_seq()))


def idle(ctx: Context, rnd: Round, now_s: float) -> None:
    """The round's steps that need no waiting action, carried out (see the module doc)."""
    ex = rnd.execution
    if not ex.lend_cores and not (ex.warm_gpu and ctx.state.gpu):
        return
    retire(ctx, rnd, now_s)
    carry_out(ctx, rnd.idle(ctx.waiting, ctx.state, now_s), now_s)


def carry_out(ctx: Context, plan: RoundPlan, now_s: float) -> None:
    """Send the round's changed loans and warm restores (after its allocations are applied)."""
    if plan.lends:
        app = ctx.sender.app
        with app.producer_or_acquire() as producer, producer.batch(max_size=1000):
            for aid, (node, ids) in plan.lends.items():
                loan = CoreLoan(action_id=aid, pool=node, cores=tuple(sorted(ids)), seq=next_seq())
                app.send_task(
                    TASK_LEND,
                    args=[loan.model_dump(mode="json")],
                    queue=queue_name("cpu", node),
                    producer=producer,
                    ignore_result=True,
                    argsrepr=f"[{aid!r}, cores={list(loan.cores)}]",
                )
                ctx.metrics.loans.labels(pool=f"cpu:{node}").inc()
    for load in plan.warm:
        warm(ctx, load, now_s)


def warm(ctx: Context, load: GpuLoad, now_s: float) -> None:
    """One warm restore: resident in the state's view from now on, sent to the node's worker
    (unless the node has `warm_up` off, or the restore failed there lately: the node's memory
    may be taken by what it loaded itself)."""
    if not _warms(ctx, load.pool) or _failed_lately(ctx, (load.pool, load.chunk, load.service)):
        return
    ctx.state.load_gpu(load, now_s)
    _send_warm(ctx, GpuWarm(pool=load.pool, chunk=load.chunk, service=load.service, seq=next_seq()))


def _failed_lately(ctx: Context, key: tuple[str, Chunk, str]) -> bool:
    """Did a warm order for this (node, chunk, service) fail less than `WARM_RETRY_S` ago?"""
    failed = ctx.books.warm_failed
    if key in failed and ctx.clock() - failed[key] >= WARM_RETRY_S:
        del failed[key]
    return key in failed


def _send_warm(ctx: Context, order: GpuWarm) -> None:
    ctx.books.warming[(order.pool, order.chunk, order.service)] = Warming(order, ctx.clock())
    ctx.sender.app.send_task(
        TASK_WARM,
        args=[order.model_dump(mode="json")],
        queue=queue_name("gpu", order.pool),
        ignore_result=True,
        argsrepr=f"[{order.op} {order.service} on {list(order.chunk)}]",
    )
    ctx.metrics.warm_orders.labels(op=order.op).inc()


def learn_residency(
    ctx: Context, node: str, resident: dict[Chunk, list[str]], settled: GpuWarm | None = None, error: str = ""
) -> None:
    """A GPU node's report of what it holds (`settled`: the warm order it answers), with the warm
    orders still under way laid over it: a load holds its chunk, an unload keeps the instance
    out, until the node answers it (or `WARM_TIMEOUT_S` passed)."""
    warming = ctx.books.warming
    now = ctx.clock()
    if settled is not None:
        key = (settled.pool, settled.chunk, settled.service)
        w = warming.get(key)
        if w is not None and w.order.seq == settled.seq:
            del warming[key]
        if error:
            log.info("warm %s of %s on %s %s: %s", settled.op, settled.service, node, settled.chunk, error)
            ctx.books.warm_failed[key] = now
    if warming:
        for k, w in list(warming.items()):
            if now - w.sent_s > WARM_TIMEOUT_S:
                del warming[k]
        resident = {c: list(s) for c, s in resident.items()}
        for (pool, chunk, service), w in warming.items():
            if pool != node:
                continue
            held = resident.setdefault(chunk, [])
            if w.order.op == "load" and service not in held:
                held.append(service)
            elif w.order.op == "unload" and service in held:
                held.remove(service)
    ctx.state.learn_residency(node, resident, now)
