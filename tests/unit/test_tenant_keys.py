"""Tenant namespacing on the in-memory twin (issue 37): keys under each tenant's prefix, ids
qualified by the scheduler from the intake an entry came on, results handed back with the
caller's own ids, controls that reach only the sender's work, and workers that act only on
the scheduler's recorded orders."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tangram_celery.client.sync import TangramClient
from tangram_celery.common.actions import ActionStatus, ApiAction, CodeAction
from tangram_celery.common.errors import AdmissionError
from tangram_celery.common.tenants import PRIORITY_OF_CLASS, Quotas, TenantRecord
from tangram_celery.common.wire import ActionMeta, ActionResult, Completion, EventStatus, TaskOrder
from tangram_celery.store import DEAD, INTAKE, RUNNING, akey, nkey, notify_key
from tangram_celery.store.base import StoreBase
from tangram_celery.store.keys import (
    MEMORY,
    entry_ref,
    intake_key,
    limits_key,
    split_ref,
)
from tangram_celery.store.worker_side import Claim, Refused
from tangram_celery.testing import dispatch, memory_store, sent_messages
from tests.unit.test_service_loop import Harness

pytestmark = pytest.mark.unit


def test_the_default_tenants_keys_are_the_single_tenant_layout() -> None:
    """Given bare ids (the default tenant's), then every key is today's; given a named tenant's
    qualified ids, then its keys are under its own prefix, and no two tenants' keys meet."""
    assert (akey("x"), nkey("x"), notify_key("c")) == ("tangram:a:x", "tangram:n:x", "tangram:nq:c")
    assert (intake_key(), limits_key()) == (INTAKE, "tangram:limits")
    assert (akey("a/x"), nkey("a/x"), notify_key("a/c")) == (
        "tangram:t:a:a:x",
        "tangram:t:a:n:x",
        "tangram:t:a:nq:c",
    )
    assert intake_key("a") == "tangram:t:a:intake" and limits_key("b") == "tangram:t:b:limits"
    assert akey("a/t:b:a:x") != akey("b/x") and MEMORY == "tangram:memory"
    assert split_ref(entry_ref("default", "1-0")) == (INTAKE, "1-0")
    assert split_ref(entry_ref("a", "1-0")) == ("tangram:t:a:intake", "1-0")


def _tenants(h: Harness, **quotas: Quotas) -> dict[str, TangramClient]:
    """Register the tenants (quotas by name) and make a client for each, on the harness's Redis."""
    for name, q in quotas.items():
        h.store.put_tenant(TenantRecord(name=name, quotas=q))
    h.svc.sync_tenants()
    return {
        name: TangramClient("memory://", config=h.cfg, store=memory_store(h.store.server, tenant=name))
        for name in quotas
    }


def _run_all(h: Harness, orders: list[tuple[str, TaskOrder]]) -> dict[str, Claim]:
    """Be the workers: claim each order as the scheduler sent it and complete it with a result
    naming the ids the worker saw."""
    claims: dict[str, Claim] = {}
    for aid, order in orders:
        claim = h.store.claim(aid, order.attempt, "w", time.time(), order=order)
        assert isinstance(claim, Claim), (aid, claim)
        claims[aid] = claim
        res = ActionResult(
            action_id=aid,
            trajectory_id=claim.meta.trajectory_id,
            status=ActionStatus.OK,
            stdout=f"{aid} in {claim.payload['trajectory_id']}",
        )
        ev = Completion(status=EventStatus.OK, worker="w", act_s=0.1)
        h.store.complete(aid, res.model_dump_json(), ev, claim.notify)
    return claims


def test_two_tenants_with_the_same_ids_each_get_their_own_work_back(tmp_path: Any) -> None:
    """Given tenants a and b (b of class high) and the default tenant each submitting action
    "x1" of trajectory "t1", when the scheduler reads their intakes, then it holds three
    actions with qualified ids, the named tenants' job id being their name and their priority
    their class's; the workers run each in its own tenant's trajectory, and each caller gets
    its own result back under its own ids."""
    h = Harness(str(tmp_path))
    h.svc.start()
    clients = _tenants(h, a=Quotas(), b=Quotas(priority="high"))
    handles = {
        name: c.submit(ApiAction(id="x1", trajectory_id="t1", api="calc", request={"who": name}, priority=5))
        for name, c in (*clients.items(), ("default", h.client))
    }
    h.svc.on_intake(h.store.read(100, None)[0])
    queued = {qa.action_id: qa for qa in h.svc.waiting}
    assert set(queued) == {"x1", "a/x1", "b/x1"}
    assert queued["b/x1"].trajectory_id == "b/t1" and queued["b/x1"].job_id == "b"
    assert queued["b/x1"].priority == PRIORITY_OF_CLASS["high"] and queued["a/x1"].priority == 0
    assert queued["x1"].priority == 5 and queued["x1"].job_id == "default"
    orders: list[tuple[str, TaskOrder]] = []
    for _ in range(3):  # one API slot: one at a time
        h.svc.schedule()
        orders += h.messages("tangram.api.calc")
        _run_all(h, orders[-1:])
        h.svc.step(block_ms=None)
    assert sorted(a for a, _ in orders) == ["a/x1", "b/x1", "x1"]
    for name, handle in handles.items():
        res = handle.result(timeout=1)
        qualified = "x1" if name == "default" else f"{name}/x1"
        assert (res.action_id, res.trajectory_id) == ("x1", "t1")
        assert res.stdout == f"{qualified} in {qualified.replace('x1', 't1')}"
    sent_messages(h.app, "tangram.api.calc")


def test_a_tenant_cancels_and_closes_only_its_own_work(tmp_path: Any) -> None:
    """Given tenants a and b with queued action "x1" of trajectory "t1" each, when b cancels
    "x1" and closes "t1", then only b's action is cancelled (a's is queued still and runs), the
    scheduler hears of it on b's intake and drops b/x1 only, and the close names b/t1."""
    h = Harness(str(tmp_path))
    h.svc.start()
    clients = _tenants(h, a=Quotas(), b=Quotas())
    for c in clients.values():
        c.submit(ApiAction(id="x1", trajectory_id="t1", api="calc", request={}))
    h.svc.on_intake(h.store.read(100, None)[0])
    closes: list[str] = []
    request_close = h.svc.trajectories.request_close

    def spy(tid: str, ref: str) -> None:
        closes.append(tid)
        request_close(tid, ref)

    h.svc.trajectories.request_close = spy  # type: ignore[method-assign,assignment]
    assert clients["b"].cancel("x1") is True
    clients["b"].close_trajectory("t1")
    assert clients["a"].store.action_state("x1") == "queued"
    assert clients["b"].store.action_state("x1") == "cancelled"
    h.svc.on_intake(h.store.read(100, None)[0])
    assert [qa.action_id for qa in h.svc.waiting] == ["a/x1"]
    assert closes == ["b/t1"] and h.store.r.xlen(intake_key("b")) == 0  # closed and acknowledged
    assert h.svc.schedule() == 1
    sent_messages(h.app, "tangram.api.calc")


def test_a_tenant_over_its_own_max_queued_is_refused_for_itself_alone(tmp_path: Any) -> None:
    """Given tenant a limited to 1 queued action, when it submits a second, then it gets
    AdmissionError naming its own limit, while tenant b goes on."""
    h = Harness(str(tmp_path))
    h.svc.start()
    clients = _tenants(h, a=Quotas(max_queued=1), b=Quotas())
    h.svc.dispatcher.tenants.sync(h.svc.round)  # the tenant book publishes the limits
    assert h.store.r.hget(limits_key("a"), "max_queued") == "1"
    clients["a"].submit(ApiAction(id="x1", api="calc", request={}))
    with pytest.raises(AdmissionError, match="tenant's intake is full"):
        clients["a"].submit(ApiAction(id="x2", api="calc", request={}))
    clients["b"].submit(ApiAction(id="x1", api="calc", request={}))
    clients["b"].submit(ApiAction(id="x2", api="calc", request={}))


def test_an_entry_or_control_naming_a_qualified_id_is_refused(tmp_path: Any) -> None:
    """Given raw intake entries that name qualified ids (another tenant's work), then the
    action and the controls are dead-lettered: none reaches tenant a's work."""
    h = Harness(str(tmp_path))
    h.svc.start()
    clients = _tenants(h, a=Quotas())
    clients["a"].submit(CodeAction(id="x1", trajectory_id="t1", code="print(1)"))
    meta = str(h.store.r.hget(akey("a/x1"), "meta")).replace('"x1"', '"a/x9"')
    h.store.r.xadd(INTAKE, {"id": "a/x9", "meta": meta})
    h.store.r.xadd(INTAKE, {"control": "close", "trajectory_id": "a/t1"})
    h.store.r.xadd(INTAKE, {"control": "cancel", "id": "a/x1"})
    h.svc.on_intake(h.store.read(100, None)[0])
    assert [qa.action_id for qa in h.svc.waiting] == ["a/x1"]
    assert not h.svc.trajectories.closing and h.store.r.xlen(DEAD) == 3


def test_a_worker_runs_only_the_order_the_scheduler_recorded(tmp_path: Any) -> None:
    """Given a dispatched action, when a message names another pool, other cores or another
    attempt than its dispatch record, then the claim is refused as unordered and nothing
    changes; the recorded order is claimed. An action without a record is never claimed."""
    store = memory_store()
    action = CodeAction(id="x1", trajectory_id="t1", code="print(1)")
    store.submit([(action.id, ActionMeta.of(action, 0.0).dumps(), action.model_dump_json())], 0)
    order = dispatch(store, "x1", kind="cpu", pool="n0", unit_ids=(0, 1))
    forged = [
        order.model_copy(update={"pool": "n1"}),
        order.model_copy(update={"unit_ids": (2, 3)}),
        order.model_copy(update={"kind": "gpu"}),
    ]
    for bad in forged:
        assert store.claim("x1", 1, "w", time.time(), order=bad) is Refused.UNORDERED
    assert store.r.hget(akey("x1"), "state") == "dispatched"
    store.r.hdel(RUNNING, "x1")
    assert store.claim("x1", 1, "w", time.time(), order=order) is Refused.UNORDERED
    order = dispatch(store, "x1", kind="cpu", pool="n0", unit_ids=(0, 1))
    assert isinstance(store.claim("x1", 1, "w", time.time(), order=order), Claim)


def test_a_notify_list_of_another_tenant_is_never_pushed_onto(tmp_path: Any) -> None:
    """Given tenant b's action whose hash was made to name tenant a's notification list, when
    its worker completes it, then the result goes to b's own list and a's list stays empty."""
    server = memory_store().server
    b = memory_store(server, tenant="b")
    action = ApiAction(id="x1", api="calc", request={})
    b.submit([(action.id, ActionMeta.of(action, 0.0).dumps(), action.model_dump_json())], 0)
    victim = notify_key("a/listener")
    b.r.hset(akey("b/x1"), "notify", victim)
    sched = memory_store(server)
    order = dispatch(sched, "b/x1")
    claim = sched.claim("b/x1", 1, "w", time.time(), order=order)
    assert isinstance(claim, Claim) and claim.notify == victim
    res = ActionResult(action_id="b/x1", status=ActionStatus.OK)
    sched.complete("b/x1", res.model_dump_json(), Completion(status=EventStatus.OK), claim.notify)
    assert sched.r.llen(victim) == 0 and sched.r.llen(nkey("b/x1")) == 1
    assert ActionResult.model_validate_json(b.wait_result("x1", 1) or "").action_id == "x1"


def test_the_scheduler_publishes_memory_and_clients_read_it(tmp_path: Any) -> None:
    """Given a published memory use over the admitted fraction, then a tenant client refuses
    to enqueue (it reads `tangram:memory`, not INFO)."""
    store = memory_store(tenant="a")
    store.r.set(MEMORY, f"{90 << 20} {100 << 20}")
    assert StoreBase.memory_use(store) == (90 << 20, 100 << 20)
    store.r.delete(MEMORY)
    assert StoreBase.memory_use(store) == (0, 0)  # a named tenant never asks INFO


def test_a_completion_wakes_the_list_a_retried_submit_named_since_the_claim() -> None:
    """Given an action claimed while its hash named client c1's list, when another client (c2)
    submits it again before it completes, then its completion wakes c2 (the hash's list now,
    checked by the worker), not c1 and not the action's own list."""
    import tangram_celery.store.client_ops as ops

    store = memory_store()
    action = ApiAction(id="x1", api="calc", request={})
    item = (action.id, ActionMeta.of(action, 0.0).dumps(), action.model_dump_json())
    c1, c2 = notify_key("c1"), notify_key("c2")
    store.r.script_load(ops.SUBMIT)
    batch = ops.SubmitBatch([item], 0, "0", c1)
    batch.take(store.send_all(batch.pending(), raise_on_error=False))
    order = dispatch(store, "x1")
    claim = store.claim("x1", 1, "w", time.time(), order=order)
    assert isinstance(claim, Claim) and claim.notify == c1
    batch = ops.SubmitBatch([item], 0, "0", c2)  # the retry: 'already', and the hash names c2
    batch.take(store.send_all(batch.pending(), raise_on_error=False))
    assert batch.replies == ["already"]
    res = ActionResult(action_id="x1", status=ActionStatus.OK)
    assert store.complete("x1", res.model_dump_json(), Completion(status=EventStatus.OK), claim.notify)
    assert (store.r.llen(c1), store.r.llen(c2), store.r.llen(nkey("x1"))) == (0, 1, 0)


def test_a_tenant_intake_deleted_by_hand_is_made_again(tmp_path: Any) -> None:
    """Given a tenant's intake deleted while the scheduler reads it, then the next read makes
    its group again and the scheduler goes on (and a removed tenant's intake is no longer read)."""
    h = Harness(str(tmp_path))
    h.svc.start()
    _tenants(h, a=Quotas())
    h.store.r.delete(intake_key("a"))
    assert h.store.read(10, None) == ([], [])
    assert h.store.r.exists(intake_key("a"))
    h.store.remove_tenant("a")
    h.svc.sync_tenants()
    assert intake_key("a") not in h.store.intakes


def test_an_action_its_tenants_caps_can_never_hold_is_refused_at_intake(tmp_path: Any) -> None:
    """Given tenant a capped at 1 core, when it submits an action that needs 2, then the
    scheduler refuses it with the reason (it would wait for ever), and a 1-core one queues."""
    h = Harness(str(tmp_path))
    h.svc.start()
    clients = _tenants(h, a=Quotas(max_cores=1))
    h.svc.dispatcher.tenants.sync(h.svc.round)  # the round has the caps
    big = clients["a"].submit(CodeAction(id="big", trajectory_id="t1", code="print(1)", cpus=2))
    clients["a"].submit(CodeAction(id="small", trajectory_id="t2", code="print(1)"))
    h.svc.on_intake(h.store.read(100, None)[0])
    res = big.result(timeout=5)
    assert res.status is ActionStatus.REJECTED and "never hold it" in (res.detail or res.error or ""), res
    assert "a/small" in h.svc.books.waiting
