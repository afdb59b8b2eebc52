"""A malformed intake entry is dead-lettered, its action rejected, and the scheduler goes on."""

from __future__ import annotations

import json
import time
from pathlib import Path


def test_malformed_intake_entries_are_dead_lettered_and_never_crash_the_scheduler(
    redis_url: str, tmp_path: Path
) -> None:
    """Given intake entries with bad JSON, a non-object meta, meta failing the scheduler's checks
    and a valid action behind them, one scheduler step rejects the bad ones with a reason (their
    callers are woken), parks them in tangram:dead, dispatches the valid one; a restarted
    scheduler does not read them again (no crash loop)."""
    from scheduler.service import SchedulerService
    from tangram_celery.client.sync import TangramClient
    from tangram_celery.common.actions import ApiAction
    from tangram_celery.common.config import parse_config
    from tangram_celery.common.wire import ActionResult
    from tangram_celery.store import Store, akey

    cfg = parse_config(
        {
            "state_dir": str(tmp_path),
            "nodes": {"cpu": [{"name": "n0", "cores": 2, "memory_mb": 1024}]},
            "apis": [
                {"name": "calc", "handler": "tangram_celery.apis.builtin:calculator", "max_concurrency": 2}
            ],
        }
    )
    svc = SchedulerService(cfg, redis_url, record=False)
    svc.start()
    store = Store(redis_url)
    for aid, meta in [
        ("bad-json", "{not json"),
        ("bad-type", "[1, 2]"),
        ("bad-cpus", json.dumps({"id": "bad-cpus", "type": "code", "trajectory_id": "t", "cpus": "x"})),
    ]:
        store.r.hset(akey(aid), mapping={"meta": meta, "payload": "{}", "state": "queued"})
        store.r.xadd("tangram:intake", {"id": aid, "meta": meta})
    store.r.xadd("tangram:intake", {"control": "close"})  # a close without a trajectory
    client = TangramClient(redis_url, config=cfg)
    good = client.submit(ApiAction(trajectory_id="t", api="calc", request={"expr": "1+1"}))
    deadline = time.monotonic() + 10
    while svc.dispatched_total == 0 and time.monotonic() < deadline:
        svc.step(block_ms=100)
    assert svc.dispatched_total == 1 and svc.books.running(good.id) is not None
    for aid in ("bad-json", "bad-type", "bad-cpus"):
        res = ActionResult.model_validate_json(store.wait_result(aid, timeout_s=5) or "{}")
        assert res.status == "rejected" and "malformed intake entry" in res.error
    dead = store.r.xrange("tangram:dead")
    assert len(dead) == 4 and all(f["reason"] for _, f in dead)
    assert store.r.xlen("tangram:intake") == 0
    again = SchedulerService(cfg, redis_url, record=False)
    again.start()  # recovery re-reads pending entries: none of the bad ones is left
    assert len(again.waiting) == 0
    client.close()
    store.close()
