"""GPU worker: forwards reward actions to the node's Triton-hosted reward service.

Requests for the same model that wait together in this worker go as one batch (see
`Batcher`); replicas are loaded on the scheduler's GPU chunk on demand and evicted LRU by
`reward_servers.replicas.ReplicaManager` (evict-on-execution).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from tangram_celery.actions import ActionResult, ActionStatus, RewardAction
from tangram_celery.config import GpuNodeConfig, TangramConfig
from tangram_celery.workers.batcher import Batcher

if TYPE_CHECKING:
    from tangram_celery.metrics import WorkerMetrics


class GpuHandler:
    def __init__(self, cfg: TangramConfig, node: GpuNodeConfig, metrics: WorkerMetrics | None = None) -> None:
        from reward_servers.service import RewardService

        self.cfg = cfg
        self.node = node.name
        self.metrics = metrics
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()
        self.service = RewardService(cfg, node.name).start()
        models = {m.name: m for m in cfg.reward_models}
        self.batcher = Batcher(
            self.service.score_timed,
            window_s=lambda m: models[m].batch_window_ms / 1000.0,
            max_batch=lambda m: models[m].max_batch,
        )

    def __call__(self, action_id: str, payload: dict[str, Any], alloc: dict[str, Any]) -> ActionResult:
        from reward_servers.errors import InputRejected

        action = RewardAction.model_validate(payload)
        chunk = tuple(int(g) for g in alloc.get("unit_ids") or ()) or None
        try:
            scored = self.batcher.submit(action.model, action.inputs, chunk)
        except InputRejected as e:
            return ActionResult(action_id=action_id, status=ActionStatus.REJECTED, error=str(e))
        finally:
            self._count_replica_changes()
        # exec_s is the scoring alone: a replica load depends on the placement, not on the call
        return ActionResult(
            action_id=action_id, status=ActionStatus.OK, output=scored.output, exec_s=scored.exec_s
        )

    def _count_replica_changes(self) -> None:
        """Carry the replica manager's eviction and load counts into the Prometheus counters."""
        manager = self.service.manager
        if self.metrics is None or manager is None:
            return
        with self._lock:
            for stat, counter in (("evictions", self.metrics.evictions), ("loads", self.metrics.restores)):
                now = int(manager.stats.get(stat, 0))
                if now > self._seen.get(stat, 0):
                    counter.labels(node=self.node).inc(now - self._seen.get(stat, 0))
                self._seen[stat] = now

    def event_extra(self) -> dict[str, Any]:
        """Sent with each completion: the node's cached services, so that the scheduler prefers
        chunks that already hold an action's model (evict-on-execution)."""
        return {"resident": self.service.resident_models()}

    def close(self) -> None:
        self.service.stop()
