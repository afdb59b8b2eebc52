"""Cancelling a queued action against a real Redis: it succeeds only before dispatch."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tangram_celery.common.admission import cancelled_result
from tangram_celery.common.wire import ActionMeta, AllocationWire, Completion, DispatchRecord, EventStatus
from tangram_celery.store import EVENTS, INTAKE, Store, akey, nkey


def _submit(store: Store, action_id: str) -> None:
    meta = ActionMeta(id=action_id, type="api", api="calc", trajectory_id="t", submitted_s=time.time())
    store.submit([(action_id, meta.dumps(), '{"p": 1}')], max_queued=0)


def _record(action_id: str) -> DispatchRecord:
    return DispatchRecord(
        alloc=AllocationWire(action_id=action_id, kind="api", pool="calc", units=1),
        meta=ActionMeta(id=action_id, type="api", api="calc", submitted_s=time.time()),
    )


def test_a_queued_action_is_cancelled_and_leaves_the_intake(redis_url: str) -> None:
    """Given a queued action, cancel succeeds: its intake entry is gone, its result says
    cancelled, its waiter is woken and the scheduler gets a cancel notice on the intake (the
    caller's own stream: nothing is written on the shared events stream)."""
    store = Store(redis_url)
    store.ensure_groups()
    _submit(store, "c1")
    assert store.queued_count() == 1
    assert store.cancel("c1", cancelled_result("c1", "deadline")) == "cancelled"
    notices = [e for _, e in store.r.xrange(INTAKE)]
    assert notices == [{"control": "cancel", "id": "c1"}]  # the action's own entry is gone
    assert store.action_state("c1") == "cancelled"
    assert json.loads(store.r.hget(akey("c1"), "result"))["status"] == "cancelled"
    assert json.loads(store.r.lpop(nkey("c1")))["status"] == "cancelled"
    assert store.r.xlen(EVENTS) == 0
    # a second cancel changes nothing and says so
    assert store.cancel("c1", cancelled_result("c1", "again")) == "cancelled"
    assert store.r.xlen(INTAKE) == 1


def test_a_dispatched_action_cannot_be_cancelled(redis_url: str) -> None:
    """Once the scheduler persisted its allocation, cancel refuses and the action runs."""
    store = Store(redis_url)
    store.ensure_groups()
    _submit(store, "c2")
    entries, _ = store.read(10, None)
    assert store.mark_dispatched([_record("c2")], {}, [e.stream_id for e in entries], time.time()) == []
    assert store.cancel("c2", cancelled_result("c2", "late")) == "dispatched"
    assert store.action_state("c2") == "dispatched"
    assert not isinstance(store.claim("c2", 1, "w", time.time(), order=_record("c2").alloc), str)
    assert store.cancel("c2", cancelled_result("c2", "late")) == "running"


def test_dispatch_skips_an_action_cancelled_after_the_policy_chose_it(redis_url: str) -> None:
    """A scheduler that read the action before it was cancelled cannot dispatch it: the dispatch
    script skips it (and returns it), dispatches the others, and no worker can claim it."""
    store = Store(redis_url)
    store.ensure_groups()
    _submit(store, "c3")
    _submit(store, "c4")
    entries, _ = store.read(10, None)
    assert store.cancel("c3", cancelled_result("c3", "deadline")) == "cancelled"
    skipped = store.mark_dispatched(
        [_record("c3"), _record("c4")], {}, [e.stream_id for e in entries], time.time()
    )
    assert skipped == ["c3"]
    assert store.states(["c3", "c4"]) == ["cancelled", "dispatched"]
    assert store.claim("c3", 1, "w", time.time()) == "cancelled"
    assert [e for _, e in store.r.xrange(INTAKE)] == [{"control": "cancel", "id": "c3"}]
    assert store.complete("c3", "{}", Completion(status=EventStatus.OK)) is False


def test_an_action_sent_back_to_the_queue_after_a_dispatch_is_not_cancelled(redis_url: str) -> None:
    """An action re-routed to the queue (state queued, but dispatched before) may have run in
    part: cancel refuses it."""
    store = Store(redis_url)
    store.ensure_groups()
    _submit(store, "c5")
    entries, _ = store.read(10, None)
    store.mark_dispatched([_record("c5")], {}, [e.stream_id for e in entries], time.time())
    assert store.requeue("c5", "", "queued", 1, time.time())
    assert store.action_state("c5") == "queued"
    assert store.cancel("c5", cancelled_result("c5", "deadline")) == "queued"
    assert store.action_state("c5") == "queued"


def _scheduler(redis_url: str, tmp_path: Path) -> Any:
    from scheduler.service import SchedulerService
    from tangram_celery.common.config import parse_config

    cfg = parse_config(
        {
            "state_dir": str(tmp_path),
            "nodes": {"cpu": [{"name": "n0", "cores": 2, "memory_mb": 1024}]},
            "scheduler": {"policy": "fcfs-min"},
        }
    )
    svc = SchedulerService(cfg, redis_url, record=False)
    svc.start()
    return svc, cfg


def _celery_messages(store: Store) -> int:
    return int(store.r.llen("tangram.cpu.n0"))


def test_the_scheduler_drops_an_action_cancelled_while_it_waits(redis_url: str, tmp_path: Path) -> None:
    """An action in the scheduler's waiting queue (no free core) that is cancelled leaves the
    queue on the cancel notice, frees its trajectory's count, and is never sent to a worker."""
    from tangram_celery.client.sync import TangramClient
    from tangram_celery.common.actions import CodeAction

    svc, cfg = _scheduler(redis_url, tmp_path)
    store = Store(redis_url)
    client = TangramClient(redis_url, config=cfg)
    hog = client.submit(CodeAction(trajectory_id="t1", code="x", cpus=2))
    waiting = client.submit(CodeAction(trajectory_id="t2", code="y"))
    svc.step(block_ms=100)
    assert svc.books.running(hog.id) is not None and waiting.id in svc.waiting  # both cores held by the hog
    assert client.cancel(waiting.id, "test") is True
    svc.step(block_ms=100)
    assert waiting.id not in svc.waiting and svc.trajectories.active.get("t2", 0) == 0
    assert svc.metrics.registry.get_sample_value("tangram_cancelled_total") == 1
    assert _celery_messages(store) == 1  # the hog's only
    client.close()
    store.close()


def test_a_cancel_between_decision_and_dispatch_sends_nothing(redis_url: str, tmp_path: Path) -> None:
    """The policy chose an action, then its caller cancelled it before the scheduler persisted
    the allocation: the dispatch script skips it, its cores are given back, no message is sent,
    and the next action gets the cores."""
    from tangram_celery.client.sync import TangramClient
    from tangram_celery.common.actions import CodeAction

    svc, cfg = _scheduler(redis_url, tmp_path)
    store = Store(redis_url)
    client = TangramClient(redis_url, config=cfg)
    first = client.submit(CodeAction(trajectory_id="t1", code="x", cpus=2))
    intake, events = store.read(10, 100)
    svc.on_events(events)
    svc.on_intake(intake)  # in the waiting queue; the policy has not run yet
    assert client.cancel(first.id, "deadline") is True  # the notice is not read yet
    assert svc.schedule() == 0
    assert svc.books.running(first.id) is None and first.id not in svc.state.running
    assert len(svc.state.cpu["n0"].free) == 2 and _celery_messages(store) == 0
    assert store.action_state(first.id) == "cancelled"
    second = client.submit(CodeAction(trajectory_id="t2", code="y", cpus=2))
    svc.step(block_ms=100)  # reads the cancel notice (ignored: already dropped) and the new one
    assert svc.books.running(second.id) is not None and _celery_messages(store) == 1
    assert svc.trajectories.active.get("t1", 0) == 0
    client.close()
    store.close()
