"""The scheduler service's loop, liveness and recovery on the in-memory twin of the store
(fakeredis running the real Lua scripts) and Celery's memory:// transport.

Workers are played by the test: it reads the Celery messages the loop sent, claims and
completes actions through the store, and writes heartbeats, exactly as a worker process does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from scheduler.service import SchedulerService
from tangram_celery.client.sync import TangramClient
from tangram_celery.common.actions import ActionStatus, ApiAction, CodeAction, RewardAction
from tangram_celery.common.admission import cancelled_result
from tangram_celery.common.config import TangramConfig, parse_config
from tangram_celery.common.records import PinRecord
from tangram_celery.common.wire import ActionResult, ChunkServices, Completion, EventStatus, TaskOrder
from tangram_celery.store import EVENTS, INTAKE, RUNNING, WORKER_POOLS, WORKERS, Store, akey
from tangram_celery.testing import MemoryStore, memory_app, memory_store, sent_messages


class Clock:
    """The scheduler's clock, moved by the test."""

    def __init__(self, now_s: float) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def config(tmp: str, **extra: Any) -> TangramConfig:
    data: dict[str, Any] = {
        "state_dir": tmp,
        "nodes": {
            "cpu": [
                {"name": "n0", "cores": 2, "memory_mb": 1024},
                {"name": "n1", "cores": 2, "memory_mb": 1024},
            ],
            "gpu": [{"name": "g0", "num_gpus": 2, "gpu_memory_mb": 2048}],
        },
        "apis": [{"name": "calc", "handler": "m:f", "max_concurrency": 1}],
        "reward_models": [
            {"name": "rm", "backend": "hf-seq-cls", "path": "/m", "memory_mb": 1500, "max_batch": 4},
            {"name": "sim", "backend": "embedding-sim", "path": "/m", "memory_mb": 1500},
        ],
        "scheduler": {"policy": "fcfs-min"},
    }
    data.update(extra)
    return parse_config(data)


class Harness:
    """A scheduler on the twin, a client on the same store, and the test as its workers."""

    def __init__(self, tmp: str, store: MemoryStore | None = None, cfg: TangramConfig | None = None) -> None:
        self.cfg = cfg or config(tmp)
        self.store = store or memory_store()
        self.app = memory_app()
        self.clock = Clock(time.time())
        self.svc = SchedulerService(
            self.cfg, "memory://", store=self.store, app=self.app, clock=self.clock, record=False
        )
        self.client = TangramClient("memory://", config=self.cfg, store=self.store)

    def restart(self) -> Harness:
        """A new scheduler process over the same Redis (the old one died)."""
        h = Harness.__new__(Harness)
        h.cfg, h.store, h.app, h.clock, h.client = (
            self.cfg,
            memory_store(self.store.server),
            self.app,
            self.clock,
            self.client,
        )
        h.svc = SchedulerService(h.cfg, "memory://", store=h.store, app=h.app, clock=h.clock, record=False)
        h.svc.start()
        return h

    def messages(self, queue: str) -> list[tuple[str, TaskOrder]]:
        """(action id, order) of every message sent to `queue` since last asked."""
        out = []
        for task, args in sent_messages(self.app, queue):
            if task.startswith("tangram.run_"):  # not closes, loans or warm orders
                out.append((str(args[0]), TaskOrder.model_validate(args[1])))
        return out

    def run(
        self,
        action_id: str,
        order: TaskOrder,
        status: EventStatus = EventStatus.OK,
        worker: str = "w",
        **ev: Any,
    ) -> None:
        """Be the worker: claim the action for its attempt, then complete it."""
        claimed = self.store.claim(action_id, order.attempt, worker, time.time())
        assert not isinstance(claimed, str), claimed
        res = ActionResult(action_id=action_id, status=ActionStatus(status.value))
        self.store.complete(
            action_id, res.model_dump_json(), Completion(status=status, worker=worker, act_s=0.1, **ev)
        )


@pytest.fixture
def h(tmp_path: Any) -> Iterator[Harness]:
    harness = Harness(str(tmp_path))
    harness.svc.start()
    yield harness
    sent_messages(harness.app, "tangram.cpu.n0")  # the memory transport is per process: drain it
    for q in ("tangram.cpu.n1", "tangram.gpu.g0", "tangram.api.calc"):
        sent_messages(harness.app, q)


def test_an_action_is_dispatched_run_and_released(h: Harness) -> None:
    """Given a code action, one step sends its order (cores, attempt 1, a new sandbox) and
    persists its dispatch record; when its worker completes it, the next step releases its
    cores and keeps its trajectory pinned for the next action, and its record is forgotten
    with the scheduler's next command to Redis (here its next read)."""
    handle = h.client.submit(CodeAction(id="a1", trajectory_id="t", code="print(1)"))
    assert h.svc.step(block_ms=None) == 1
    [(aid, order)] = h.messages("tangram.cpu.n0") or h.messages("tangram.cpu.n1")
    assert aid == "a1" and order.attempt == 1 and len(order.unit_ids) == 1
    assert order.sandbox is not None and order.sandbox.new and order.sandbox.gen == "a1"
    assert h.store.r.hexists(RUNNING, "a1")
    h.run(aid, order)
    h.svc.step(block_ms=None)
    assert not h.svc.state.running and h.store.r.hexists(RUNNING, "a1")  # owed
    h.svc.step(block_ms=None)
    assert not h.store.r.hexists(RUNNING, "a1")
    assert h.svc.state.trajectory_node["t"] == order.pool
    assert handle.result(timeout=1).status is ActionStatus.OK


def test_a_rider_handed_back_before_it_started_goes_again_alone_and_is_not_given_up(h: Harness) -> None:
    """Given a code action on its last allowed attempt, when its worker hands it back unstarted
    (an action ahead of it in its batch overran), then the scheduler neither gives up on it nor
    counts a failure: it is sent again (the next attempt), never to ride again, and completes;
    a retryable failure on that same last attempt is given up as before."""
    handle = h.client.submit(CodeAction(id="r1", trajectory_id="t", code="print(1)"))
    h.svc.step(block_ms=None)
    [(aid, order)] = h.messages("tangram.cpu.n0") or h.messages("tangram.cpu.n1")
    last = h.svc.liveness.max_attempts
    h.svc.books.set_attempt(aid, last)
    claimed = h.store.claim(aid, order.attempt, "w", time.time())
    assert not isinstance(claimed, str), claimed
    back = Completion(
        status=EventStatus.RETRY, error="ahead of it ran long", trajectory_id="t", unstarted=True
    )
    assert h.store.give_back(aid, "w", order.attempt, back)
    h.svc.step(block_ms=None)
    [(again, order2)] = h.messages("tangram.cpu.n0") or h.messages("tangram.cpu.n1")
    assert again == "r1" and order2.attempt == last + 1 and h.svc.books.running("r1").solo
    h.run(again, order2)
    h.svc.step(block_ms=None)
    assert handle.result(timeout=1).status is ActionStatus.OK
    failed = h.client.submit(CodeAction(id="r2", trajectory_id="u", code="print(2)"))
    h.svc.step(block_ms=None)
    [(aid, order)] = h.messages("tangram.cpu.n0") or h.messages("tangram.cpu.n1")
    h.svc.books.set_attempt(aid, last)
    assert not isinstance(h.store.claim(aid, order.attempt, "w", time.time()), str)
    crash = Completion(status=EventStatus.RETRY, error="reward server crashed", trajectory_id="u")
    assert h.store.give_back(aid, "w", order.attempt, crash)
    h.svc.step(block_ms=None)
    assert failed.result(timeout=1).status is ActionStatus.ERROR


def test_an_action_cancelled_before_dispatch_never_runs(h: Harness) -> None:
    """Given an API action behind one holding the API's only slot, when its caller cancels it,
    the scheduler drops it from the waiting queue and never sends it."""
    first = h.client.submit(ApiAction(id="x1", trajectory_id="t", api="calc"))
    h.client.submit(ApiAction(id="x2", trajectory_id="t", api="calc"))
    h.svc.step(block_ms=None)
    assert "x2" in h.svc.waiting and h.svc.books.running(first.id) is not None
    assert h.client.cancel("x2")
    h.svc.step(block_ms=None)
    assert "x2" not in h.svc.waiting and h.svc.trajectories.active["t"] == 1
    assert [a for a, _ in h.messages("tangram.api.calc")] == ["x1"]


def test_malformed_intake_is_dead_lettered_and_refused_actions_get_a_reason(h: Harness) -> None:
    """Given an entry whose metadata is not JSON and one naming an unknown model, one step
    dead-letters the first and finishes the second as rejected; neither stays queued."""
    h.store.r.hset(akey("bad"), mapping={"meta": "{nope", "payload": "{}", "state": "queued"})
    h.store.r.xadd(INTAKE, {"id": "bad", "meta": "{nope"})
    meta = {"id": "zz", "type": "reward", "model": "unknown", "submitted_s": 1.0}
    h.store.r.hset(akey("zz"), mapping={"meta": json.dumps(meta), "payload": "{}", "state": "queued"})
    h.store.r.xadd(INTAKE, {"id": "zz", "meta": json.dumps(meta)})
    h.svc.step(block_ms=None)
    bad = ActionResult.model_validate_json(h.store.wait_result("bad", 1) or "{}")
    refused = ActionResult.model_validate_json(h.store.wait_result("zz", 1) or "{}")
    assert bad.status is ActionStatus.REJECTED and "malformed intake entry" in bad.error
    assert refused.status is ActionStatus.REJECTED and "unknown reward model" in refused.error
    assert len(h.store.r.xrange("tangram:dead")) == 1 and not h.svc.waiting


def test_gpu_riders_share_the_leaders_chunk_as_one_batch(h: Harness) -> None:
    """Given three reward actions of a model with max_batch 4 and one free GPU, the round sends
    all three on one chunk with batch 3 (two ride on the first's allocation)."""
    h.svc.state.gpu["g0"].free.discard(1)  # GPU 1 is busy elsewhere
    for i in range(3):
        h.client.submit(
            RewardAction(
                id=f"r{i}", trajectory_id=f"t{i}", model="rm", inputs={"prompt": "p", "response": "r"}
            )
        )
    assert h.svc.step(block_ms=None) == 3
    orders = h.messages("tangram.gpu.g0")
    assert {(o.unit_ids, o.batch) for _, o in orders} == {((0,), 3)}
    assert h.svc.state.shared == {"r1", "r2"}


def test_the_round_predicts_a_restore_and_learns_the_reported_residency(h: Harness) -> None:
    """Given rm resident on GPU 0 (reported), an action of model sim placed there evicts rm in
    the scheduler's view at once; the node's report with the completion then replaces it."""
    h.store.publish_residency("g0", {(0,): ["rm"]})
    h.svc.state.gpu["g0"].free.discard(1)
    h.svc.step(block_ms=None)
    assert h.svc.state.gpu["g0"].resident == {(0,): ["rm"]}
    h.client.submit(
        RewardAction(id="s1", trajectory_id="t", model="sim", inputs={"response": "x", "reference": "y"})
    )
    h.svc.step(block_ms=None)
    assert h.svc.state.gpu["g0"].resident == {(0,): ["sim"]}  # 1500 + 1500 MiB > 2048: rm goes
    [(aid, order)] = h.messages("tangram.gpu.g0")
    h.run(aid, order, resident=[ChunkServices(gpus=(0,), services=["rm", "sim"])])
    h.svc.step(block_ms=None)
    assert h.svc.state.gpu["g0"].resident == {(0,): ["rm", "sim"]}


def _beat(store: Store, worker: str, pool: str, at_s: float) -> None:
    store.r.hset(WORKERS, worker, at_s)
    store.r.hset(WORKER_POOLS, worker, pool)


def test_liveness_retries_an_action_whose_worker_died(h: Harness) -> None:
    """Given an API action claimed by a worker that stopped beating, the liveness pass takes it
    back and sends it again as attempt 2; the dead worker's late claim of attempt 1 is refused."""
    h.client.submit(ApiAction(id="l1", trajectory_id="t", api="calc"))
    h.svc.step(block_ms=None)
    [(aid, _)] = h.messages("tangram.api.calc")
    assert h.store.claim(aid, 1, "dead", time.time()) != "running"
    _beat(h.store, "dead", "api:calc", time.time() - 60)
    _beat(h.store, "alive", "api:calc", time.time())
    h.svc.check()
    [(again, order2)] = h.messages("tangram.api.calc")
    assert again == "l1" and order2.attempt == 2
    assert h.store.claim("l1", 1, "dead", time.time()) == "stale"
    h.run("l1", order2, worker="alive")
    h.svc.step(block_ms=None)
    assert not h.svc.state.running


def test_liveness_takes_a_node_offline_and_reroutes_its_actions(h: Harness) -> None:
    """Given a code action running on a node whose only worker stopped beating, the pass takes
    the node offline, puts the action back in the queue and unpins its trajectory (marked
    reset); the next round places it on the other node, whose units the dead one's never get."""
    h.client.submit(CodeAction(id="c1", trajectory_id="t", code="x"))
    h.svc.step(block_ms=None)
    [(aid, order)] = h.messages("tangram.cpu.n0") + h.messages("tangram.cpu.n1")
    other = "n1" if order.pool == "n0" else "n0"
    h.store.claim(aid, 1, "w-dead", time.time())
    _beat(h.store, "w-dead", f"cpu:{order.pool}", time.time() - 60)
    _beat(h.store, "w-other", f"cpu:{other}", time.time())
    h.svc.check()
    assert f"cpu:{order.pool}" in h.svc.state.offline and not h.svc.state.cpu[order.pool].free
    assert "c1" in h.svc.waiting and "t" not in h.svc.state.trajectory_node
    assert "t" in h.svc.trajectories.sandboxes.reset
    h.svc.step(block_ms=None)
    [(again, order2)] = h.messages(f"tangram.cpu.{other}")
    assert again == "c1" and order2.sandbox is not None and order2.sandbox.reset


def test_liveness_forgets_an_action_whose_record_vanished(h: Harness) -> None:
    """Given a dispatched action whose hash was deleted, the pass frees its units."""
    h.client.submit(ApiAction(id="v1", trajectory_id="t", api="calc"))
    h.svc.step(block_ms=None)
    h.store.r.delete(akey("v1"))
    h.svc.check()
    assert not h.svc.state.running and h.svc.state.api["calc"].in_flight == 0


def test_recovery_rebuilds_running_pins_and_queue_after_a_restart(h: Harness) -> None:
    """Given a scheduler that dispatched one action (running, its trajectory pinned) and queued
    another, a new scheduler over the same store holds the same cores and pin, queues the
    waiting action again, and re-sends the dispatched one (its worker's claim makes that safe)."""
    h.client.submit(CodeAction(id="k1", trajectory_id="t", code="x", memory_mb=600))
    h.client.submit(CodeAction(id="k2", trajectory_id="u", code="x", memory_mb=600, cpus=2))
    h.client.submit(CodeAction(id="k3", trajectory_id="w", code="x", memory_mb=600, cpus=2))
    h.svc.step(block_ms=None)
    before = dict(h.svc.state.running)
    pinned = dict(h.svc.state.trajectory_node)
    waiting = [a.action_id for a in h.svc.waiting]
    h.messages("tangram.cpu.n0"), h.messages("tangram.cpu.n1")
    again = h.restart()
    assert again.svc.state.running == before and again.svc.state.trajectory_node == pinned
    assert [a.action_id for a in again.svc.waiting] == waiting
    resent = again.messages("tangram.cpu.n0") + again.messages("tangram.cpu.n1")
    assert sorted(a for a, _ in resent) == sorted(before)
    for aid, order in resent:
        again.run(aid, order)
    again.svc.step(block_ms=None)
    assert set(again.svc.books.running_ids()) == set(waiting)


def test_recovery_replays_unacknowledged_events(h: Harness) -> None:
    """Given a completion event the old scheduler read but died before handling, the new one
    replays it at start and releases the units."""
    h.client.submit(ApiAction(id="e1", trajectory_id="t", api="calc"))
    h.svc.step(block_ms=None)
    [(aid, order)] = h.messages("tangram.api.calc")
    h.run(aid, order)
    _, delivered = h.store.read(10, None)  # delivered to the scheduler, never acknowledged
    assert [e.fields["id"] for e in delivered] == ["e1"]
    again = h.restart()
    assert not again.svc.state.running and again.store.r.xlen(EVENTS) == 0


def test_a_completion_is_written_with_the_next_read_or_replayed_after_a_restart(h: Harness) -> None:
    """Given a completion the scheduler handled, its writes (record forgotten, pin written,
    event acknowledged) are owed until the scheduler's next command; a scheduler that dies
    before that replays the event and reaches the same state, and one that lives writes them
    with its next read."""
    h.client.submit(CodeAction(id="o1", trajectory_id="t", code="x"))
    h.svc.step(block_ms=None)
    [(aid, order)] = h.messages("tangram.cpu.n0") + h.messages("tangram.cpu.n1")
    h.run(aid, order)
    h.svc.step(block_ms=None)
    assert not h.svc.state.running and h.store.r.hexists(RUNNING, "o1")  # owed
    assert h.store.r.xlen(EVENTS) == 1
    h.svc.step(block_ms=None)
    assert not h.store.r.hexists(RUNNING, "o1") and h.store.r.xlen(EVENTS) == 0
    assert h.store.load_pins()["t"].node == order.pool

    h.client.submit(CodeAction(id="o2", trajectory_id="t", code="x"))
    h.svc.step(block_ms=None)
    [(aid, order)] = h.messages("tangram.cpu.n0") + h.messages("tangram.cpu.n1")
    h.run(aid, order)
    h.svc.step(block_ms=None)  # handled, owed, and then the scheduler dies
    again = h.restart()
    assert not again.svc.state.running and again.svc.state.trajectory_node["t"] == order.pool
    again.svc.step(block_ms=None)
    assert not again.store.r.hexists(RUNNING, "o2") and again.store.r.xlen(EVENTS) == 0
    assert again.store.load_pins()["t"].node == order.pool


def test_an_owed_pin_is_written_before_a_later_change_of_it() -> None:
    """Writes `events_done` owes go to Redis before any other command of the scheduler's, in
    order: a pin owed and then deleted stays deleted."""
    store = memory_store()
    store.events_done(["x1"], {"t": PinRecord(node="n0")}, [])
    store.forget_pin("t")
    assert store.load_pins() == {}
    store.events_done([], {"u": PinRecord(node="n0")}, [])
    store.update_pins({}, forget=["u"])
    assert store.load_pins() == {}


def test_a_cancel_after_the_round_chose_the_action_undoes_its_pin(h: Harness) -> None:
    """Given a round that chose an action which its caller cancelled in between, the dispatch
    script skips it: its cores and the pin it made are given back and nothing is sent."""
    h.client.submit(CodeAction(id="u1", trajectory_id="t", code="x"))
    new, _ = h.store.read(10, None)
    h.svc.on_intake(new)
    assert h.store.cancel("u1", cancelled_result("u1", "late")) == "cancelled"
    assert h.svc.schedule() == 0
    assert not h.svc.state.running and "t" not in h.svc.state.trajectory_node
    assert not h.messages("tangram.cpu.n0") and not h.messages("tangram.cpu.n1")


def test_recovery_survives_a_running_action_that_evicted(tmp_path: Any) -> None:
    """Given an action that evicted an idle trajectory and still runs, a restarted scheduler
    rebuilds its state without evicting again (the evicted pin is gone from Redis already)."""
    cfg = config(
        str(tmp_path),
        nodes={"cpu": [{"name": "n0", "cores": 2, "memory_mb": 1024}]},
        apis=[],
        reward_models=[],
    )
    h = Harness(str(tmp_path), cfg=cfg)
    h.svc.start()
    h.client.submit(CodeAction(id="first", trajectory_id="t1", code="x", memory_mb=600))
    h.svc.step(block_ms=None)
    [(aid, order)] = h.messages("tangram.cpu.n0")
    h.run(aid, order)
    h.svc.step(block_ms=None)  # t1 is idle, pinned, holding 600 MiB
    h.client.submit(CodeAction(id="second", trajectory_id="t2", code="x", memory_mb=600))
    h.svc.step(block_ms=None)
    [(aid, order)] = h.messages("tangram.cpu.n0")
    assert aid == "second" and order.evict == ("t1",)
    again = h.restart()
    assert set(again.svc.state.running) == {"second"}
    assert again.svc.state.trajectory_node == {"t2": "n0"}
    assert again.svc.state.cpu["n0"].trajectory_memory_mb == {"t2": 600}


def test_a_completion_delivered_twice_is_logged_and_counted_once(tmp_path: Any) -> None:
    """Given a completion event that reaches the scheduler twice (a restarted Redis that lost
    its last second of AOF takes the worker's retried completion again), then the run log has
    one record of it."""
    from scheduler.model import Allocation, CostVector, Elastic, QueuedAction, ResourceKind
    from scheduler.service.record import RunRecorder
    from tangram_celery.common.wire import Completion, EventStatus

    rec = RunRecorder(tmp_path / "actions.jsonl")
    action = QueuedAction("a/x1", "a/t1", CostVector(ResourceKind.CPU, Elastic((1,)), memory_mb=128), 1.0)
    alloc = Allocation("a/x1", ResourceKind.CPU, "n0", 1, (0,))
    ev = Completion(status=EventStatus.OK, queue_s=0.1, act_s=0.3, attempt=1)
    rec.completed(action, alloc, ev)
    rec.completed(action, alloc, ev)
    rec.completed(action, alloc, ev.model_copy(update={"attempt": 2}))  # a new attempt: logged
    rec.close()
    lines = (tmp_path / "actions.jsonl").read_text().splitlines()
    assert [json.loads(x)["attempt"] for x in lines] == [1, 2]
