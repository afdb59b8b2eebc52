"""The GPU worker reports the restore tier of each call and the node's host-memory tier (issue 38),
against a fake reward service (no Triton)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from reward_servers.service import Traced
from scheduler.gpu_cache import Tier
from tangram_celery.common.actions import ActionStatus, RewardAction
from tangram_celery.common.config import TangramConfig, parse_config
from tangram_celery.common.wire import TaskOrder
from tangram_celery.workers.gpu import GpuHandler


class FakeService:
    """What `GpuHandler` calls of `reward_servers.service.RewardService`: the first call of a
    chunk restores its model from host memory, the next ones find it on the device."""

    def __init__(self, cfg: TangramConfig, node: str) -> None:
        self.manager = None
        self.calls: list[tuple[str, int, tuple[int, ...] | None]] = []
        self.on_device: dict[tuple[int, ...], list[str]] = {}
        self.in_host: dict[tuple[int, ...], list[str]] = {(0,): ["rm"], (1,): ["rm"]}

    def start(self) -> FakeService:
        return self

    def score_traced(
        self, model: str, rows: list[Any], chunk: tuple[int, ...] | None = None, dop: Any = None
    ) -> Traced:
        self.calls.append((model, len(rows), chunk))
        assert chunk is not None
        if model in self.on_device.get(chunk, []):
            return Traced([{"score": 1.0} for _ in rows], 0.01, Tier.DEVICE, 0.0)
        self.in_host[chunk].remove(model)
        self.on_device.setdefault(chunk, []).append(model)
        return Traced([{"score": 1.0} for _ in rows], 0.01, Tier.HOST, 0.03)

    def resident_models(self) -> dict[tuple[int, ...], list[str]]:
        return {c: list(s) for c, s in self.on_device.items() if s}

    def host_resident_models(self) -> dict[tuple[int, ...], list[str]]:
        return {c: list(s) for c, s in self.in_host.items() if s}

    def stop(self) -> None:
        pass


class FakeStore:
    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []

    def publish_residency(
        self, node: str, resident: Any, warm: Any = None, error: str = "", host_resident: Any = None
    ) -> None:
        self.reports.append({"node": node, "resident": resident, "host": host_resident, "warm": warm})


@pytest.fixture
def handler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> GpuHandler:
    import reward_servers.service
    import reward_servers.tiny_models

    monkeypatch.setattr(reward_servers.service, "RewardService", FakeService)
    monkeypatch.setattr(reward_servers.tiny_models, "build_missing", lambda cfg, log: None)
    cfg = parse_config(
        {
            "state_dir": str(tmp_path),
            "nodes": {"gpu": [{"name": "g0", "num_gpus": 2, "gpu_memory_mb": 1024}]},
            "reward_models": [{"name": "rm", "backend": "hf-seq-cls", "path": "/m", "max_batch": 4}],
        }
    )
    return GpuHandler(cfg, cfg.nodes.gpu[0], store=FakeStore(), warm=False)  # type: ignore[arg-type]


def _order(action: RewardAction, batch: int = 1) -> TaskOrder:
    return TaskOrder(action_id=action.id, kind="gpu", pool="g0", units=1, unit_ids=(0,), batch=batch)


def test_each_rider_of_a_batch_that_paid_a_restore_reports_it(handler: GpuHandler) -> None:
    """Given two reward actions sent together on GPU 0, where rm is kept in host memory, both
    results say the call restored it from host memory (0.03 s); the next call is a device hit."""
    actions = [RewardAction(trajectory_id=f"t{i}", model="rm", inputs={"response": "x"}) for i in range(2)]
    results = {}

    def one(a: RewardAction) -> None:
        results[a.id] = handler(a.id, a.model_dump(), _order(a, batch=2))

    threads = [threading.Thread(target=one, args=(a,)) for a in actions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fake = handler.service
    assert isinstance(fake, FakeService) and fake.calls == [("rm", 2, (0,))]
    assert {(r.status, r.load_tier, r.load_s, r.batch_size) for r in results.values()} == {
        (ActionStatus.OK, "host", 0.03, 2)
    }
    again = actions[0].model_copy(update={"id": "again"})
    hit = handler(again.id, again.model_dump(), _order(again))
    assert (hit.load_tier, hit.load_s) == ("device", 0.0)


def test_completions_and_reports_carry_the_host_tier(handler: GpuHandler) -> None:
    """The handler's maps for completions name the device-resident and the host-only replicas;
    its residency report carries both."""
    a = RewardAction(trajectory_id="t", model="rm", inputs={"response": "x"})
    handler(a.id, a.model_dump(), _order(a))
    assert handler.residency() == {(0,): ["rm"]}
    assert handler.host_residency() == {(1,): ["rm"]}
    handler._publish_residency()
    store = handler.store
    assert isinstance(store, FakeStore)
    assert store.reports[-1]["host"] == {(1,): ["rm"]} and store.reports[-1]["resident"] == {(0,): ["rm"]}
