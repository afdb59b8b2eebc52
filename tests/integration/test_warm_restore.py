"""Warm GPU restores carried out for real: the scheduler (`tangram-fast`) on real Redis sends a
warm restore to an idle GPU node, the GPU worker's handler loads the replica on a real
tritonserver (nvidia-pytriton, CPU-kind instances) and reports the node's residency, and a
reward call then lands on the warm chunk without loading anything.

The scheduler's steps and the worker's handler are driven from the test (the Celery messages are
read from their queue in Redis), so each hand-off is checked where it happens.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.triton import reward_config_dict

pytestmark = pytest.mark.slow


def _take(store: Any, queue: str) -> list[tuple[str, list[Any]]]:
    """(task name, args) of every Celery message waiting in `queue` (kombu's Redis list), taken."""
    out = []
    while (raw := store.r.rpop(queue)) is not None:
        msg = json.loads(raw)
        args, _, _ = json.loads(base64.b64decode(msg["body"]))
        out.append((msg["headers"]["task"], args))
    return out


def test_an_idle_gpu_node_gets_a_warm_restore_and_the_next_call_finds_it(
    redis_url: str, tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    """Given an idle 2-GPU node configured for reward model rm and nothing loaded, when the
    scheduler steps, then it sends a warm restore of rm and counts it resident on its chunk; a
    residency report that does not list it yet leaves it held; the GPU worker loads the replica
    on Triton and reports residency naming the order, which settles it; a reward action then
    goes to that chunk and is scored with no on-demand load."""
    from reward_servers.naming import replica_name
    from scheduler.service import SchedulerService
    from tangram_celery.client.sync import TangramClient
    from tangram_celery.common.actions import RewardAction
    from tangram_celery.common.config import parse_config
    from tangram_celery.common.errors import RewardServerError
    from tangram_celery.common.wire import GpuWarm
    from tangram_celery.store import Store
    from tangram_celery.workers.base import WorkerRuntime
    from tangram_celery.workers.gpu import GpuHandler
    from tests.fixtures.common import unavailable

    raw = reward_config_dict(tmp_path / "state", tiny_models)
    raw["reward_models"] = [m for m in raw["reward_models"] if m["name"] == "rm"]
    raw["scheduler"] = {"policy": "tangram-fast"}
    cfg = parse_config(raw)
    store = Store(redis_url)
    svc = SchedulerService(cfg, redis_url, record=False)
    svc.start()
    try:
        handler = GpuHandler(cfg, cfg.nodes.gpu[0], store=store, warm=False)  # no start-up warm-up
    except (RewardServerError, OSError) as e:
        unavailable(f"tritonserver cannot start: {e}")
    runtime = WorkerRuntime(redis_url, "gpu", "g0")
    try:
        svc.step(block_ms=50)
        msgs = _take(store, "tangram.gpu.g0")
        assert [task for task, _ in msgs] == ["tangram.warm_gpu"], msgs
        order = GpuWarm.model_validate(msgs[0][1][0])
        assert (order.op, order.service, order.pool) == ("load", "rm", "g0")
        assert "rm" in svc.state.gpu["g0"].resident[order.chunk]

        store.publish_residency("g0", {})  # a report sent while the replica loads
        svc.step(block_ms=50)
        assert "rm" in svc.state.gpu["g0"].resident[order.chunk]
        assert _take(store, "tangram.gpu.g0") == [], "held: not placed a second time"

        handler.warm(order)
        assert handler.service.resident_models() == {order.chunk: ["rm"]}
        assert handler.service.controller.is_ready(replica_name("rm", len(order.chunk), order.chunk))  # type: ignore[union-attr]
        assert handler.service.manager.stats["warm_loads"] == 1  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while svc.warmer.warming and time.monotonic() < deadline:
            svc.step(block_ms=100)
        assert not svc.warmer.warming and svc.state.gpu["g0"].resident == {order.chunk: ["rm"]}

        with TangramClient(redis_url, config=cfg) as client:
            h = client.submit(RewardAction(trajectory_id="t", model="rm", inputs={"response": "fine"}))
            svc.step(block_ms=100)
            [(task, (aid, alloc))] = _take(store, "tangram.gpu.g0")
            assert task == "tangram.run_gpu" and tuple(alloc["unit_ids"]) == order.chunk
            assert runtime.execute(aid, alloc, handler) == "ok"
            res = h.result(timeout=60)
        assert res.ok and "score" in res.output, res  # type: ignore[operator]
        assert handler.service.manager.stats["loads"] == 0, "the call found its replica warm"  # type: ignore[union-attr]
    finally:
        handler.close()
        store.close()
