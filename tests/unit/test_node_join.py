"""Nodes joining, draining and leaving at run time, on the scheduler's loop over the in-memory
twin of the store: the test plays the workers (their records, heartbeats, claims)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tangram_celery.common.actions import ActionStatus, CodeAction
from tangram_celery.common.node_record import NodeRecord, NodeState
from tangram_celery.common.wire import ActionResult, Completion, EventStatus, TaskOrder
from tangram_celery.store import Store
from tangram_celery.testing import memory_app, memory_store, sent_messages
from tests.unit.test_service_loop import Harness, _beat, config

QUEUES = ("tangram.cpu.n0", "tangram.cpu.x1", "tangram.cpu.x2")


@pytest.fixture
def h(tmp_path: Any) -> Iterator[Harness]:
    cfg = config(
        str(tmp_path),
        nodes={"cpu": [{"name": "n0", "cores": 1, "memory_mb": 1024}]},
        apis=[],
        reward_models=[],
    )
    for q in QUEUES:  # the memory transport is per process: what other tests left
        sent_messages(memory_app(), q)
    harness = Harness(str(tmp_path), cfg=cfg)
    harness.svc.start()
    _beat(harness.store, "w-n0", "cpu:n0", time.time())
    yield harness
    for q in QUEUES:
        sent_messages(harness.app, q)


def join(store: Store, name: str, state: NodeState = NodeState.READY, cores: int = 2) -> NodeRecord:
    """Be a worker of undeclared node `name`: register it and beat."""
    rec = NodeRecord(
        name=name, kind="cpu", state=state, worker=f"w-{name}", numa=(tuple(range(cores)),), memory_mb=2048
    )
    store.register_node(rec)
    _beat(store, f"w-{name}", f"cpu:{name}", time.time())
    return rec


def code_messages(h: Harness, node: str) -> list[tuple[str, TaskOrder]]:
    return h.messages(f"tangram.cpu.{node}")


def test_an_undeclared_node_that_registers_takes_work_from_the_next_step(h: Harness) -> None:
    """Given the only declared core busy and an action waiting, when an undeclared node
    registers as ready, the next pass adds it and the waiting action is sent there; a node
    still joining (its consumer not up) is not used."""
    h.client.submit(CodeAction(id="a1", trajectory_id="t1", code="x"))
    h.client.submit(CodeAction(id="a2", trajectory_id="t2", code="x"))
    h.svc.step(block_ms=None)
    assert [a for a, _ in code_messages(h, "n0")] == ["a1"] and "a2" in h.svc.waiting
    join(h.store, "x1", NodeState.JOINING)
    h.svc.sync_nodes()
    h.svc.step(block_ms=None)
    assert "x1" not in h.svc.state.cpu and "a2" in h.svc.waiting
    join(h.store, "x1")
    h.svc.sync_nodes()
    h.svc.step(block_ms=None)
    [(aid, order)] = code_messages(h, "x1")
    assert aid == "a2" and order.pool == "x1" and order.unit_ids[0] in (0, 1)


def test_a_node_registered_while_the_scheduler_was_down_is_there_after_a_restart(h: Harness) -> None:
    """Given a ready node's record, a new scheduler adds it at start (before recovery)."""
    join(h.store, "x1")
    h2 = h.restart()
    assert "x1" in h2.svc.state.cpu and h2.svc.view.max_cpus == 2


def test_a_draining_node_takes_nothing_new_and_its_idle_trajectories_move(h: Harness) -> None:
    """Given a trajectory pinned to x1 (idle) and one running there, when x1 drains: nothing new
    is placed there, the idle trajectory is released (its next action goes elsewhere, reported
    as a reset), the running action completes as usual, and its trajectory is released then."""
    join(h.store, "x1")
    h.svc.sync_nodes()
    for aid in ("d1", "d2"):
        h.client.submit(CodeAction(id=aid, trajectory_id=f"t{aid}", code="x"))
    h.svc.step(block_ms=None)
    sent = dict(code_messages(h, "x1") + code_messages(h, "n0"))
    assert sorted(a for a, o in sent.items() if o.pool == "x1") == ["d1", "d2"]  # most memory free
    idle, busy = "d1", "d2"
    h.run(idle, sent[idle], worker="w-x1")
    h.svc.step(block_ms=None)
    h.svc.step(block_ms=None)
    assert h.svc.state.trajectory_node[f"t{idle}"] == "x1"
    h.store.claim(busy, 1, "w-x1", time.time())  # it runs there when the drain starts
    h.store.set_node_state("x1", "w-x1", NodeState.DRAINING, time.time())
    h.svc.check()
    assert "cpu:x1" in h.svc.nodes.draining
    assert f"t{idle}" not in h.svc.state.trajectory_node and f"t{idle}" in h.svc.trajectories.sandboxes.reset
    # new work and the idle trajectory's next action go elsewhere, never to x1
    h.client.submit(CodeAction(id="d4", trajectory_id=f"t{idle}", code="x"))
    h.svc.step(block_ms=None)
    assert not code_messages(h, "x1")
    [(moved, order)] = code_messages(h, "n0")
    assert moved == "d4" and order.sandbox is not None and order.sandbox.reset and order.sandbox.new
    assert "x1 was drained" in (order.sandbox.why or "")  # the result's detail says so
    assert h.svc.state.trajectory_node[f"t{busy}"] == "x1"
    res = ActionResult(action_id=busy, status=ActionStatus.OK)
    h.store.complete(busy, res.model_dump_json(), Completion(status=EventStatus.OK, worker="w-x1", act_s=0.1))
    h.svc.step(block_ms=None)
    h.svc.check()
    assert f"t{busy}" not in h.svc.state.trajectory_node
    assert not any(a.pool == "x1" for a in h.svc.state.running.values())
    assert not code_messages(h, "x1")


def test_a_node_that_left_is_removed_and_what_it_never_took_goes_elsewhere(h: Harness) -> None:
    """Given an action sent to x1 that x1 never took, when x1 leaves (its worker drained and
    exited), the pass takes it back to the queue and places it on another node; x1 is removed
    from the state and its record dropped, and nothing runs twice (the old message is stale)."""
    join(h.store, "x1")
    h.svc.sync_nodes()
    h.client.submit(CodeAction(id="b0", trajectory_id="u0", code="x"))  # takes n0's core
    h.client.submit(CodeAction(id="b1", trajectory_id="u1", code="x"))
    h.svc.step(block_ms=None)
    sent = dict(code_messages(h, "x1") + code_messages(h, "n0"))
    stranded = next(a for a, o in sent.items() if o.pool == "x1")
    other = next(a for a in sent if a != stranded)
    h.run(other, sent[other], worker="w-n0")  # n0's core is free again
    h.svc.step(block_ms=None)
    h.store.set_node_state("x1", "w-x1", NodeState.DRAINING, time.time())
    h.store.set_node_state("x1", "w-x1", NodeState.LEFT, time.time())
    h.store.forget_worker("w-x1")
    h.svc.check()
    h.svc.step(block_ms=None)
    [(again, order)] = code_messages(h, "n0")
    assert again == stranded and order.attempt == sent[stranded].attempt + 1
    assert h.store.claim(stranded, sent[stranded].attempt, "w-x1", time.time()) == "stale"
    h.run(stranded, order, worker="w-n0")
    h.svc.step(block_ms=None)
    h.svc.check()
    assert "x1" not in h.svc.state.cpu and "x1" not in h.store.node_records()


def test_only_the_incarnation_that_registered_moves_the_record_on() -> None:
    """A worker's late state change does not overwrite the record of the node's next worker."""
    store = memory_store()
    join(store, "x1")
    store.register_node(NodeRecord(name="x1", kind="cpu", worker="w-new", numa=((0,),), memory_mb=64))
    assert not store.set_node_state("x1", "w-x1", NodeState.LEFT, 1.0)
    assert store.set_node_state("x1", "w-new", NodeState.READY, 2.0)
    rec = store.node_records()["x1"]
    assert rec.state is NodeState.READY and rec.ready_s == 2.0
    assert not store.drop_left_node("x1", "w-new")


def test_tangram_nodes_shows_state_capacity_and_load(h: Harness) -> None:
    """`tangram nodes` lists a joined node as ready with its cores, memory and the scheduler's
    load, a draining one as draining, one whose worker stopped beating as lost, and the
    declared node that never registered by its heartbeat; --json has the same rows."""
    from tangram_celery.nodes import format_table, node_rows, show

    join(h.store, "x1")
    join(h.store, "x2")
    join(h.store, "x3")
    _beat(h.store, "w-x3", "cpu:x3", time.time() - 60)
    h.store.set_node_state("x2", "w-x2", NodeState.DRAINING, time.time())
    h.svc.check()
    rows = {r["node"]: r for r in node_rows(h.store)}
    assert rows["x1"]["state"] == "ready" and rows["x1"]["cores"] == 2 and rows["x1"]["memory_mb"] == 2048
    assert rows["x1"]["load"]["in_use"] == 0 and rows["x1"]["load"]["units"] == 2
    assert rows["x2"]["state"] == "draining" and rows["x3"]["state"] == "lost"
    assert rows["n0"]["state"] == "ready" and "worker" not in rows["n0"]
    table = format_table(list(rows.values()))
    assert "draining" in table and "2 cores" in table and "0/2" in table
    import json

    assert {r["node"] for r in json.loads(show(h.store, as_json=True))} == {"n0", "x1", "x2", "x3"}


def test_an_undeclared_gpu_node_joins_with_its_own_residency(tmp_path: Any) -> None:
    """Given the declared GPU node's GPUs busy and a reward action waiting, when an undeclared
    GPU node registers (2 GPUs), the action is sent there and the node predicts what it loads
    (its own GPU cache); it takes warm orders like a declared node."""
    from tangram_celery.common.actions import RewardAction

    for q in ("tangram.gpu.g0", "tangram.gpu.g9"):
        sent_messages(memory_app(), q)
    h = Harness(str(tmp_path))
    h.svc.start()
    try:
        h.svc.state.gpu["g0"].free.clear()
        h.client.submit(
            RewardAction(id="r1", trajectory_id="t", model="rm", inputs={"prompt": "p", "response": "r"})
        )
        h.svc.step(block_ms=None)
        assert "r1" in h.svc.waiting
        h.store.register_node(
            NodeRecord(
                name="g9", kind="gpu", state=NodeState.READY, worker="w-g9", num_gpus=2, gpu_memory_mb=4096
            )
        )
        _beat(h.store, "w-g9", "gpu:g9", time.time())
        h.svc.sync_nodes()
        h.svc.schedule()
        [(aid, order)] = h.messages("tangram.gpu.g9")
        assert aid == "r1" and order.pool == "g9"
        assert h.svc.state.gpu["g9"].resident and "g9" in h.svc.state.gpu_cache
        assert "g9" in h.svc.warmer.warm_nodes
    finally:
        for q in ("tangram.gpu.g0", "tangram.gpu.g9", "tangram.cpu.n0", "tangram.cpu.n1"):
            sent_messages(h.app, q)
