"""The client side of the store without I/O (`store/client_ops.py`, `client/core.py`): what each
operation sends and how its reply reads, checked without Redis, and once through the blocking
executor on the in-memory store."""

from __future__ import annotations

import pytest
from redis.exceptions import NoScriptError, ResponseError

import tangram_celery.store.client_ops as ops
from tangram_celery.client.core import ClientCore
from tangram_celery.common.actions import ApiAction
from tangram_celery.common.admission import cancelled_result
from tangram_celery.common.errors import ActionRejected, AdmissionError, BrokerError
from tangram_celery.common.wire import PoolView
from tangram_celery.store.calls import Backoff
from tangram_celery.store.keys import INTAKE, akey, limits_key
from tangram_celery.store.scripts import CANCEL, SUBMIT

LIMITS = limits_key()


def test_a_batch_sends_each_item_by_digest_and_again_once_after_a_missing_script() -> None:
    """Given two items whose first reply is a missing script for the second, then only that one
    is pending again; a second miss ends the batch with the error as its reply."""
    batch = ops.SubmitBatch([("a", "{}", "{}"), ("b", "{}", "{}")], 5, ops.ttl_arg(0), notify="nq")
    first, second = batch.pending()
    assert first.method == "evalsha" and first.script == SUBMIT
    assert first.args == (ops.SUBMIT_SHA, 2, INTAKE, akey("a"), "a", "{}", "{}", 5, "0", "nq", LIMITS)
    assert not batch.take(["1-0", NoScriptError("NOSCRIPT")])
    assert batch.pending() == [second]
    miss = NoScriptError("NOSCRIPT")
    assert batch.take([miss])
    assert batch.replies == ["1-0", miss]


def test_refusals_read_as_the_errors_a_caller_sees() -> None:
    """A full intake and a Redis out of memory are admission errors, a reused id a rejection,
    anything else a broker error; a resubmission is named for its waiter to read first."""
    items = [("a", "", ""), ("b", "", "")]
    assert ops.check_submitted(items, ["1-0", "already"], 9) == ["b"]
    with pytest.raises(AdmissionError, match="intake is full"):
        ops.check_submitted(items, ["1-0", ResponseError("TANGRAM_FULL")], 9)
    with pytest.raises(AdmissionError, match="maxmemory"):
        ops.check_submitted(items, [ResponseError("OOM command not allowed"), "x"], 9)
    with pytest.raises(ActionRejected):
        ops.check_submitted(items, [ResponseError("TANGRAM_DUPLICATE"), "x"], 9)
    with pytest.raises(BrokerError):
        ops.check_submitted(items, [ValueError("?"), "x"], 9)


def test_memory_is_read_at_most_every_quarter_second_and_again_after_a_refusal() -> None:
    """Given a Redis above the admitted fraction of its maxmemory, then the batch is refused
    and the next submit reads its memory again at once."""
    check = ops.MemoryCheck()
    assert check.due(100.0)
    check.saw((50 << 20, 100 << 20), 100.0)
    assert not check.due(100.1)
    check.admit(0.8, 3)
    check.saw((90 << 20, 100 << 20), 100.0)
    with pytest.raises(AdmissionError, match="none of these 3"):
        check.admit(0.8, 3)
    assert check.due(100.1)


def test_replies_read_the_same_for_both_executors() -> None:
    """An outcome carries its result only once the action is final; a pop its value."""
    assert ops.outcome("a").parse(["running", None]) == ("running", None)
    assert ops.outcome("a").parse(["done", '{"x": 1}']) == ("done", '{"x": 1}')
    assert ops.outcome("a").parse([None, None]) == (None, None)
    assert ops.pop_result("a", 0.0).kwargs == {"timeout": 0.001}
    assert ops.pop_notified("nq", 2.0).parse(["nq", "r"]) == "r"
    assert ops.drain_notified("nq").parse(None) == []
    assert ops.memory_use().parse({"used_memory": 3, "maxmemory": 0}) == (3, 0)
    cancel = ops.cancel("a", "{}")
    assert cancel.script == CANCEL and cancel.args[:2] == (ops.CANCEL_SHA, 4)


def test_the_backoff_doubles_to_a_second_and_ends_when_its_budget_is_spent() -> None:
    """Waits of 0.05, 0.1, ... capped at 1 s; BrokerError once the next would pass the budget."""
    backoff = Backoff("read", "redis://:secret@host:6379", budget_s=1000.0)
    waits = [backoff.after(ConnectionError("down")) for _ in range(7)]
    assert waits == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    with pytest.raises(BrokerError, match=r"\*\*\*@host") as e:
        Backoff("read", "redis://:secret@host:6379", budget_s=0.0).after(ConnectionError("down"))
    assert "secret" not in str(e.value)


def test_the_core_checks_a_batch_against_the_pools_it_was_told() -> None:
    """Without a view the core asks for one; an id given twice is refused before any I/O."""
    core = ClientCore(None)
    assert core.wants_view(0.0) and core.checked_view() is None
    core.saw_view(PoolView(max_cpus=2, max_memory_mb=1024, apis=["calc"], max_queued=7), 0.0)
    assert not core.wants_view(1.0)
    assert core.wants_view(3.0)  # nodes join and leave: the published view is read again
    batch = core.batch([ApiAction(trajectory_id="t", api="calc")], 1.0)
    assert (batch.max_queued, batch.trajectories) == (7, ["t"])
    twice = ApiAction(api="calc")
    with pytest.raises(ActionRejected, match="twice"):
        core.batch([twice, twice], 1.0)


def test_the_blocking_executor_runs_the_calls_on_the_in_memory_store() -> None:
    """Submit, read and cancel through `Store` on fakeredis, the script cache empty at first."""
    testing = pytest.importorskip("tangram_celery.testing")
    store = testing.memory_store()
    assert store.submit([("c1", '{"id": "c1"}', "{}")], 10) == []
    assert store.action_state("c1") == "queued" and store.queued_count() == 1
    assert store.cancel("c1", cancelled_result("c1", "test")) == "cancelled"
    assert store.run(ops.outcome("c1"))[0] == "cancelled"
    assert store.wait_result("c1", 1.0, look_first=True) is not None
    assert store.cancel("nope", "{}") == "missing"


def test_a_config_without_cpu_nodes_follows_the_published_view() -> None:
    """Nodes join at run time: a client whose config declares none takes the scheduler's view
    (a code action is refused only while no node has joined) and reads it again as it grows."""
    from tangram_celery.common.actions import CodeAction
    from tangram_celery.common.config import TangramConfig

    cfg = TangramConfig.model_validate({"apis": [{"name": "calc", "handler": "m:f", "max_concurrency": 2}]})
    core = ClientCore(cfg)
    assert core.follow and core.wants_view(0.0)
    core.saw_view(PoolView(max_cpus=0, max_memory_mb=0, apis=["calc"]), 0.0)
    with pytest.raises(ActionRejected, match="no CPU node"):
        core.batch([CodeAction(code="print(1)")], 1.0)
    assert core.wants_view(2.5)
    core.saw_view(PoolView(max_cpus=4, max_memory_mb=4096, apis=["calc"]), 2.5)
    assert len(core.batch([CodeAction(code="print(1)")], 3.0).items) == 1
    declared = ClientCore(
        TangramConfig.model_validate({"nodes": {"cpu": [{"name": "a", "cores": 2, "memory_mb": 2048}]}})
    )
    assert not declared.follow and not declared.wants_view(100.0)
