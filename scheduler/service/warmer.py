"""The live executor of the round's elastic steps: core loans (sent by `Sender.lend`) and warm
GPU placements (`GpuWarmer`, which owns the warm orders under way).

The round decides them (`scheduler.round`: `RoundPlan.lends`, `RoundPlan.warm`, `Round.retire`),
the same for the simulator and the live service; the live scheduler carries them out
(`dispatch.Dispatcher`):

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from scheduler.gpu_cache import Chunk, GpuLoad
from scheduler.resources import ClusterState
from scheduler.round import Round
from scheduler.service.sender import Sender, next_seq
from tangram_celery.common.wire import GpuWarm

log = logging.getLogger("tangram.scheduler")

WARM_TIMEOUT_S = 300.0  # a warm order never answered (its worker gone) stops holding its chunk
WARM_RETRY_S = 60.0  # a warm order that failed is not sent again for that chunk for this long

WarmKey = tuple[str, Chunk, str]  # (GPU node, chunk, service)


@dataclass
class Warming:
    """A warm GPU order (`wire.GpuWarm`) sent at `sent_s` and not answered yet."""

    order: GpuWarm
    sent_s: float


class GpuWarmer:
    """Warm restores and retirements on the GPU nodes that take them (`warm_up`): sends them,
    and lays the ones under way over what the nodes report they hold (see the module doc)."""

    def __init__(
        self, state: ClusterState, sender: Sender, warm_nodes: set[str], clock: Callable[[], float]
    ) -> None:
        self.state, self.sender, self.warm_nodes, self.clock = state, sender, warm_nodes, clock
        # warm GPU orders sent and not answered yet
        self.warming: dict[WarmKey, Warming] = {}
        # warm orders (restores, retirements) that failed, when: not sent again for a while
        self.failed: dict[WarmKey, float] = {}

    def retire(self, rnd: Round, now_s: float) -> None:
        """Unload the warm instances the load outgrew (before the round decides, as the simulator)."""
        for node, chunk, service in rnd.retire(self.state, now_s):
            if node not in self.warm_nodes or self._failed_lately((node, chunk, service)):
                continue
            self.state.gpu_cache[node].unload(chunk, service)
            predict_host(self.state, node, evicted=[(chunk, service)])
            self._send(GpuWarm(op="unload", pool=node, chunk=chunk, service=service, seq=next_seq()))

    def warm(self, load: GpuLoad, now_s: float) -> None:
        """One warm restore: resident in the state's view from now on, sent to the node's worker
        (unless the node has `warm_up` off, or the restore failed there lately: the node's
        memory may be taken by what it loaded itself)."""
        if load.pool not in self.warm_nodes or self._failed_lately((load.pool, load.chunk, load.service)):
            return
        self.state.load_gpu(load, now_s)
        predict_host(self.state, load.pool, load.victims, (load.chunk, load.service))
        self._send(GpuWarm(pool=load.pool, chunk=load.chunk, service=load.service, seq=next_seq()))

    def _failed_lately(self, key: WarmKey) -> bool:
        """Did a warm order for this (node, chunk, service) fail less than `WARM_RETRY_S` ago?"""
        failed = self.failed
        if key in failed and self.clock() - failed[key] >= WARM_RETRY_S:
            del failed[key]
        return key in failed

    def _send(self, order: GpuWarm) -> None:
        self.warming[(order.pool, order.chunk, order.service)] = Warming(order, self.clock())
        self.sender.warm(order)

    def learn_residency(
        self,
        node: str,
        resident: dict[Chunk, list[str]],
        settled: GpuWarm | None = None,
        error: str = "",
        host_resident: dict[Chunk, list[str]] | None = None,
    ) -> None:
        """A GPU node's report of what it holds (`settled`: the warm order it answers; and
        `host_resident`, what it keeps in host memory only, when it has a host tier), with the
        warm orders still under way laid over it: a load holds its chunk, an unload keeps the
        instance out, until the node answers it (or `WARM_TIMEOUT_S` passed)."""
        now = self.clock()
        if settled is not None:
            self._settle(node, settled, error, now)
        if self.warming:
            resident = self._under_way(node, resident, now)
        self.state.learn_residency(node, resident, now, host_resident)

    def _settle(self, node: str, settled: GpuWarm, error: str, now_s: float) -> None:
        """The node answered warm order `settled` (with `error` when it failed)."""
        key = (settled.pool, settled.chunk, settled.service)
        w = self.warming.get(key)
        if w is not None and w.order.seq == settled.seq:
            del self.warming[key]
        if error:
            log.info("warm %s of %s on %s %s: %s", settled.op, settled.service, node, settled.chunk, error)
            self.failed[key] = now_s

    def _under_way(self, node: str, resident: dict[Chunk, list[str]], now_s: float) -> dict[Chunk, list[str]]:
        """`resident` with the node's warm orders under way laid over it (the timed out ones
        forgotten first)."""
        warming = self.warming
        for k, w in list(warming.items()):
            if now_s - w.sent_s > WARM_TIMEOUT_S:
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
        return resident


def predict_host(
    state: ClusterState,
    node: str,
    evicted: Iterable[tuple[Chunk, str]] = (),
    restored: tuple[Chunk, str] | None = None,
) -> None:
    """The host tier of GPU `node` as a load or an unload leaves it, in the state's view until
    the node reports it (a node without a host tier: nothing): instances taken off the device
    (`evicted`) keep their process and weights in host memory, and the one made resident
    (`restored`) is on the device, no longer host-only. The node's host budget may have dropped
    some; its next report says."""
    gnode = state.gpu.get(node)
    if gnode is None or not gnode.host_tier:
        return
    host = gnode.host_resident
    for chunk, service in evicted:
        kept = host.setdefault(chunk, [])
        if service not in kept:
            kept.append(service)
    if restored is not None:
        chunk, service = restored
        held = host.get(chunk)
        if held and service in held:
            held.remove(service)
            if not held:
                del host[chunk]
