"""GPU worker: forwards reward actions to the node's Triton-hosted reward service.

Requests for the same model that wait together in this worker go as one batch (see
`Batcher`); replicas are loaded on the scheduler's GPU chunk on demand and evicted LRU by
`reward_servers.replicas.ReplicaManager` (evict-on-execution). Each result says where its call
found the model (`ActionResult.load_tier`: device, host memory, cold) and what restoring it
took (`load_s`), and the node's residency goes out as two maps: on the devices, and kept in
host memory only (issue 38).

At start, a background thread warms the configured services onto free chunks as memory allows
(`RewardService.warm_up`), so that the first reward actions of a fresh deployment do not pay a
cold load; after each load the node's residency goes to the scheduler (an event), so that its
first placements pick the warm chunks. The progress is kept in Redis (`Store.warm_status`) for
`tangram up` to report.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from tangram_celery.common.actions import ActionStatus, RewardAction, stored_action
from tangram_celery.common.config import GpuNodeConfig, TangramConfig
from tangram_celery.common.records import WarmStatus
from tangram_celery.common.wire import ActionResult, GpuWarm, TaskOrder
from tangram_celery.workers.batcher import Batcher

if TYPE_CHECKING:
    from tangram_celery.common.metrics import WorkerMetrics
    from tangram_celery.store import Store

log = logging.getLogger("tangram.worker")
# the longest a scheduler's warm order waits for the node's start-up warm-up
WARM_ORDER_WAIT_S = 900.0


class GpuHandler:
    def __init__(
        self,
        cfg: TangramConfig,
        node: GpuNodeConfig,
        metrics: WorkerMetrics | None = None,
        store: Store | None = None,
        warm: bool = True,
    ) -> None:
        from reward_servers.service import RewardService
        from reward_servers.tiny_models import build_missing

        build_missing(cfg, log.info)  # a worker started on its own host builds its `build:` models too
        self.cfg = cfg
        self.node = node.name
        self.metrics = metrics
        if metrics is not None:  # exported at 0 from the start, not only after the first one
            for counter in (metrics.evictions, metrics.restores, metrics.warm_loads):
                counter.labels(node=node.name)
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()
        self.service = RewardService(cfg, node.name).start()
        models = {m.name: m for m in cfg.reward_models}
        self.batcher = Batcher(
            self.service.score_traced,
            window_s=lambda m: models[m].batch_window_ms / 1000.0,
            max_batch=lambda m: models[m].max_batch,
        )
        self.store = store
        self.warmer: threading.Thread | None = None
        if warm:
            self.warmer = threading.Thread(target=self._warm_up, name="tangram-gpu-warm-up", daemon=True)
            self.warmer.start()

    def _warm_up(self) -> None:
        """Load the configured services ahead of requests; report residency and progress."""
        services = [f"{m}__dop{d}" for m, d in self.service.warm_services()]
        started_s = time.time()
        self._warm_status(WarmStatus(state="warming", services=tuple(services), started_s=started_s))
        try:
            out = self.service.warm_up(on_loaded=lambda _replica: self._publish_residency())
        except Exception as e:  # warming is an optimisation: requests still load on demand
            log.exception("warm-up of %s failed", self.node)
            out = {
                "loaded": [],
                "failed": {"*": f"{type(e).__name__}: {e}"},
                "seconds": time.time() - started_s,
            }
        self._count_replica_changes()
        self._publish_residency()
        self._warm_status(WarmStatus(state="done", services=tuple(services), started_s=started_s, **out))
        log.info("warm-up of %s done: %d replica(s) in %.1f s", self.node, len(out["loaded"]), out["seconds"])

    def _publish_residency(self) -> None:
        if self.store is None:
            return
        try:
            self.store.publish_residency(
                self.node, self.service.resident_models(), host_resident=self.host_residency()
            )
        except Exception:  # a hint for placement; the next completion carries it too
            log.warning("could not publish the residency of %s", self.node, exc_info=True)

    def _warm_status(self, status: WarmStatus) -> None:
        if self.store is None:
            return
        try:
            self.store.set_warm_status(self.node, status)
        except Exception:
            log.warning("could not record the warm-up status of %s", self.node, exc_info=True)

    def __call__(self, action_id: str, payload: dict[str, Any], order: TaskOrder) -> ActionResult:
        from reward_servers.errors import InputRejected

        action = stored_action(payload)  # checked at submit: typed, not validated again
        if not isinstance(action, RewardAction):
            raise ValueError(f"action {action_id}: a {action.type} action sent to a GPU worker")
        chunk = order.unit_ids or None
        try:
            scored = self.batcher.submit(action.model, action.inputs, chunk, order.batch)
        except InputRejected as e:
            return ActionResult(action_id=action_id, status=ActionStatus.REJECTED, error=str(e))
        finally:
            self._count_replica_changes()
        # exec_s is the scoring alone: a replica load depends on the placement, not on the call
        return ActionResult(
            action_id=action_id,
            status=ActionStatus.OK,
            output=scored.output,
            exec_s=scored.exec_s,
            batch_size=scored.batch_size,
            load_tier=scored.load_tier,
            load_s=scored.load_s,
        )

    def warm(self, order: GpuWarm) -> None:
        """Carry out the scheduler's warm placement (`wire.GpuWarm`): load the service's replica
        onto the chunk in free memory (never evicting; a load already under way is waited for),
        or unload an idle one the load outgrew; then report the node's residency, naming the
        order (as after a warm-up load). An order that comes while the start-up warm-up runs
        waits for it: the scheduler sees that plan's first steps (host copies loaded and put
        away, GPUs still free) and would undo its last ones (issue 38)."""
        from reward_servers.naming import aligned_chunks, replica_name
        from reward_servers.placement import Placement

        if self.warmer is not None:
            self.warmer.join(timeout=WARM_ORDER_WAIT_S)
        manager = self.service.manager
        assert manager is not None
        error = ""
        try:
            m = self.cfg.reward_model(order.service)
            dop = len(order.chunk)
            if order.pool != self.node:
                raise ValueError(f"order for GPU node {order.pool}, this is {self.node}")
            if m is None or m.backend == "rule" or dop not in m.dop_options:
                raise ValueError(f"no {dop}-GPU service of {order.service!r} here")
            if order.chunk not in aligned_chunks(self.service.node.num_gpus, dop):
                raise ValueError(f"{order.chunk} is not a chunk of this node")
            name = replica_name(order.service, dop, order.chunk)
            if order.op == "unload":
                if not manager.retire(name) and order.service in self.service.resident_models().get(
                    order.chunk, []
                ):
                    error = "not unloaded: in use"
            elif not manager.warm(Placement(name, order.chunk, load=True)) and not manager.wait_loaded(name):
                error = "not loaded: the chunk's memory is taken"
        except Exception as e:  # a hint for placement: calls still load on demand
            error = f"{type(e).__name__}: {e}"
            log.warning("warm %s of %s on %s failed: %s", order.op, order.service, order.chunk, error)
        self._count_replica_changes()
        if self.store is not None:
            self.store.publish_residency(
                self.node,
                self.service.resident_models(),
                warm=order,
                error=error,
                host_resident=self.host_residency(),
            )

    def _count_replica_changes(self) -> None:
        """Carry the replica manager's eviction and load counts into the Prometheus counters."""
        manager = self.service.manager
        if self.metrics is None or manager is None:
            return
        with self._lock:
            for stat, counter in (
                ("evictions", self.metrics.evictions),
                ("loads", self.metrics.restores),
                ("warm_loads", self.metrics.warm_loads),
                ("host_restores", self.metrics.host_restores),
                ("offloads", self.metrics.offloads),
            ):
                now = int(manager.stats.get(stat, 0))
                if now > self._seen.get(stat, 0):
                    counter.labels(node=self.node).inc(now - self._seen.get(stat, 0))
                self._seen[stat] = now

    def residency(self) -> dict[tuple[int, ...], list[str]]:
        """Sent with each completion: the node's cached services, so that the scheduler prefers
        chunks that already hold an action's model (evict-on-execution)."""
        return self.service.resident_models()

    def host_residency(self) -> dict[tuple[int, ...], list[str]]:
        """Sent beside `residency`: the services kept in host memory only, per chunk (a call
        placed there restores them in ms instead of a cold load)."""
        return self.service.host_resident_models()

    def close(self) -> None:
        self.service.stop()
