"""Turns on a CPU worker's cores (tangram_celery.workers.turns): a message for cores another
still holds waits for it; sharers and other resources take no turn."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from tangram_celery.common.actions import ActionStatus, CodeAction
from tangram_celery.common.wire import ActionResult, TaskOrder
from tangram_celery.store import RUNNING
from tangram_celery.testing import sent_messages
from tangram_celery.workers.base import WorkerRuntime
from tangram_celery.workers.turns import CoreTurns, turn_key


def _order(**kw: object) -> TaskOrder:
    base: dict[str, object] = {"action_id": "a", "kind": "cpu", "pool": "n", "units": 1, "unit_ids": (0,)}
    return TaskOrder.model_validate({**base, **kw})


def test_turn_key_names_the_cores_of_exclusive_cpu_orders_only() -> None:
    assert turn_key(_order(unit_ids=(2, 3))) == (2, 3)
    assert turn_key(_order(shares=True)) is None  # a time sharer runs beside the holder
    assert turn_key(_order(unit_ids=())) is None
    assert turn_key(_order(kind="gpu")) is None


def test_the_same_cores_take_turns_and_other_cores_do_not_wait() -> None:
    """A second holder of the same cores enters only once the first left; a holder of other
    cores (or of none) enters at once; nothing is left behind."""
    turns = CoreTurns()
    events: list[str] = []
    first_in, release = threading.Event(), threading.Event()

    def first() -> None:
        with turns.turn((0,), 5.0) as mine:
            assert mine
            events.append("first in")
            first_in.set()
            release.wait(5)
            events.append("first out")

    def second() -> None:
        with turns.turn((0,), 5.0) as mine:
            assert mine
            events.append("second in")

    t1 = threading.Thread(target=first)
    t1.start()
    assert first_in.wait(5)
    t2 = threading.Thread(target=second)
    t2.start()
    with turns.turn((1,), 0.1) as mine:
        assert mine  # other cores: no wait
    with turns.turn(None, 0.1) as mine:
        assert mine
    time.sleep(0.1)
    assert events == ["first in"]  # the second waits
    release.set()
    t1.join(5)
    t2.join(5)
    assert events == ["first in", "first out", "second in"]
    assert turns.waiting() == 0


def test_a_turn_that_does_not_come_in_time_holds_nothing() -> None:
    """A waiter past its limit gets False and leaves the cores to their holder, who then leaves
    nothing behind."""
    turns = CoreTurns()
    with turns.turn((0, 1), 1.0) as held:
        assert held
        t0 = time.monotonic()
        with turns.turn((0, 1), 0.05) as mine:
            assert not mine
        assert time.monotonic() - t0 >= 0.05
        assert turns.waiting() == 1
    assert turns.waiting() == 0
    with turns.turn((0, 1), 0.05) as mine:
        assert mine


def test_a_batch_behind_one_that_hangs_on_its_cores_hands_its_actions_back(tmp_path: Path) -> None:
    """Given a batch that hangs on core 0 and a second batch for core 0 queued behind it (a
    join), when the second's turn does not come within the hand-back limit, then the worker
    gives its actions back unstarted (no result, a retry event each) and leaves the first alone;
    the scheduler places them again as their next attempt."""
    from tests.unit.test_service_loop import Harness

    h = Harness(str(tmp_path))
    h.svc.start()
    try:
        _hand_back_behind_a_hung_batch(h)
    finally:  # the memory transport is per process: leave no message for later tests
        for q in ("tangram.cpu.n0", "tangram.cpu.n1", "tangram.gpu.g0", "tangram.api.calc"):
            sent_messages(h.app, q)


def _hand_back_behind_a_hung_batch(h: Any) -> None:
    for aid in ("hung", "r1", "r2"):
        h.client.submit(CodeAction(id=aid, trajectory_id=f"t-{aid}", code="x"))
    h.svc.step(block_ms=None)
    records = h.store.load_running()
    assert set(records) == {"hung", "r1", "r2"}

    def item(aid: str) -> list[Any]:  # as the scheduler's batch message carries it, on core 0
        rec = records[aid]
        order = TaskOrder(
            action_id=aid, kind="cpu", pool=rec.alloc.pool, units=1, unit_ids=(0,), attempt=rec.attempt
        )
        # the scheduler's record says so too (a worker runs only what it records)
        alloc = rec.alloc.model_copy(update={"units": 1, "unit_ids": (0,)})
        h.store.r.hset(RUNNING, aid, rec.model_copy(update={"alloc": alloc}).model_dump_json())
        return [aid, order.model_dump(mode="json")]

    rt = WorkerRuntime("redis://127.0.0.1:1/0", "cpu", records["hung"].alloc.pool)
    rt.store = h.store  # the in-memory twin, as the scheduler's
    rt.batch_hand_back_s = 0.3
    started: list[str] = []
    release = threading.Event()

    def handler(action_id: str, payload: dict[str, Any], order: TaskOrder) -> ActionResult:
        started.append(action_id)
        if action_id == "hung":
            release.wait(10)
        return ActionResult(action_id=action_id, status=ActionStatus.OK)

    first: list[str] = []
    t = threading.Thread(target=lambda: first.extend(rt.execute_batch([item("hung")], handler)))
    t.start()
    deadline = time.monotonic() + 5
    while "hung" not in started and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    second = rt.execute_batch([item("r1"), item("r2")], handler)
    waited = time.monotonic() - t0
    assert second == ["handed_back", "handed_back"] and started == ["hung"]
    assert 0.25 <= waited < 5 and rt.turns.waiting() == 1  # only the hung batch holds core 0
    release.set()
    t.join(5)
    assert first == ["ok"] and rt.turns.waiting() == 0

    h.svc.step(block_ms=None)  # reads the two retries (and the completion) and places them again
    again = h.store.load_running()
    assert {aid: again[aid].attempt for aid in ("r1", "r2")} == {"r1": 2, "r2": 2}
    assert "hung" not in h.svc.state.running
