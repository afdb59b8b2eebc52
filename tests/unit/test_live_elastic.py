"""The live scheduler carries out the round's core loans and warm GPU placements
(`scheduler.service.warmer`, `Sender.lend`), on the in-memory twin of the store; the test plays the workers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tangram_celery.common.actions import CodeAction, TestCase
from tangram_celery.common.wire import CoreLoan, GpuWarm, TaskOrder
from tangram_celery.testing import sent_messages
from tests.unit.test_service_loop import Harness, config

PRIORS = {"code": {"t1_s": 100.0}, "tests": {"t1_s": 10.0, "parallel_fraction": 0.95}}


@pytest.fixture
def one_node(tmp_path: Any) -> Iterator[Harness]:
    """A tangram-fast scheduler (invariants checked) over one CPU node of 2 cores."""
    cfg = config(
        str(tmp_path),
        nodes={"cpu": [{"name": "n0", "cores": 2, "memory_mb": 4096}]},
        apis=[],
        reward_models=[],
        scheduler={"policy": "tangram-fast", "priors": PRIORS, "check_invariants": True},
    )
    h = Harness(str(tmp_path), cfg=cfg)
    sent_messages(h.app, "tangram.cpu.n0")  # memory:// is one broker per process: earlier tests' messages go
    h.svc.start()
    yield h
    sent_messages(h.app, "tangram.cpu.n0")


def _all(h: Harness, queue: str) -> list[tuple[str, list[Any]]]:
    return sent_messages(h.app, queue)


def _code(aid: str, tid: str) -> CodeAction:
    return CodeAction(id=aid, trajectory_id=tid, code="pass")


def _long_action_and_suite(h: Harness) -> tuple[dict[str, Any], dict[str, Any]]:
    """Place action a (expected long), then suite s (cpus 1..2) on the core left: their orders."""
    h.client.submit(_code("a", "ta"))
    h.svc.step(block_ms=None)
    suite = CodeAction(
        id="s",
        trajectory_id="ts",
        code="",
        cpus="1..2",
        test_cases=[TestCase(name="t", stdin="", expected_stdout="")],
    )
    h.client.submit(suite)
    h.svc.step(block_ms=None)
    [(_, [_, a_order]), (task, [_, s_order])] = _all(h, "tangram.cpu.n0")
    assert task == "tangram.run_cpu"
    return a_order, s_order


def test_spare_cores_are_lent_to_a_running_suite_and_taken_back_before_an_action_takes_them(
    one_node: Harness,
) -> None:
    """Given a suite started on the one core a long action left, when that action ends and
    nothing waits, then its core is lent to the suite (a CoreLoan on the node's queue); when a
    new action is placed on that core, the take-back (no cores) is sent ahead of the action's
    own message, with a larger seq."""
    h = one_node
    a_order, s_order = _long_action_and_suite(h)
    assert len(s_order["unit_ids"]) == 1
    h.run("a", TaskOrder.model_validate(a_order))
    h.svc.step(block_ms=None)
    [(task, [raw])] = _all(h, "tangram.cpu.n0")
    lent = CoreLoan.model_validate(raw)
    assert task == "tangram.lend_cores" and lent.action_id == "s"
    assert lent.cores == tuple(a_order["unit_ids"]) and h.svc.round.lent["s"][1] == set(lent.cores)
    h.client.submit(_code("b", "tb"))
    h.svc.step(block_ms=None)
    msgs = _all(h, "tangram.cpu.n0")
    assert [t for t, _ in msgs] == ["tangram.lend_cores", "tangram.run_cpu"]
    back = CoreLoan.model_validate(msgs[0][1][0])
    assert back.action_id == "s" and back.cores == () and back.seq > lent.seq
    assert msgs[1][1][1]["unit_ids"] == list(lent.cores)


def test_after_a_restart_a_running_suite_is_lent_cores_again(one_node: Harness) -> None:
    """Given a suite running beside a long action when the scheduler restarts, when the long
    action ends, then the new scheduler lends its core to the suite (a newer seq than any
    before the restart)."""
    h = one_node
    a_order, _ = _long_action_and_suite(h)
    h2 = h.restart()
    h2.run("a", TaskOrder.model_validate(a_order))
    h2.svc.step(block_ms=None)
    msgs = [m for m in _all(h2, "tangram.cpu.n0") if m[0] == "tangram.lend_cores"]
    [(_, [raw])] = msgs
    assert CoreLoan.model_validate(raw).cores == tuple(a_order["unit_ids"])


@pytest.fixture
def gpu(tmp_path: Any) -> Iterator[Harness]:
    """A tangram-fast scheduler over one GPU node of 2 GPUs and two reward models."""
    cfg = config(str(tmp_path), scheduler={"policy": "tangram-fast"}, apis=[])
    h = Harness(str(tmp_path), cfg=cfg)
    h.svc.start()
    yield h
    sent_messages(h.app, "tangram.gpu.g0")


def test_idle_gpus_get_warm_restores_which_hold_their_chunk_until_the_node_answers(gpu: Harness) -> None:
    """Given idle GPUs and two configured services, one idle step sends a warm load of each to
    the GPU node's queue and counts them resident; a residency report that does not list them
    yet (sent while they load) leaves them held; the node's answer to one order settles it
    (resident as reported), and a failed one is dropped and not sent again at once."""
    h = gpu
    h.svc.step(block_ms=None)
    orders = [GpuWarm.model_validate(args[0]) for task, args in _all(h, "tangram.gpu.g0")]
    assert sorted(o.service for o in orders) == ["rm", "sim"] and all(o.op == "load" for o in orders)
    resident = h.svc.state.gpu["g0"].resident
    assert {s for o in orders for s in resident.get(o.chunk, [])} == {"rm", "sim"}
    h.store.publish_residency("g0", {})
    h.svc.step(block_ms=None)
    assert {s for o in orders for s in h.svc.state.gpu["g0"].resident.get(o.chunk, [])} == {"rm", "sim"}
    rm = next(o for o in orders if o.service == "rm")
    sim = next(o for o in orders if o.service == "sim")
    h.store.publish_residency("g0", {rm.chunk: ["rm"]}, warm=rm)
    h.store.publish_residency("g0", {rm.chunk: ["rm"]}, warm=sim, error="not loaded")
    h.svc.step(block_ms=None)
    assert h.svc.state.gpu["g0"].resident == {rm.chunk: ["rm"]}
    assert not h.svc.warmer.warming
    assert not [o for o in _all(h, "tangram.gpu.g0") if GpuWarm.model_validate(o[1][0]).chunk == sim.chunk]


def test_the_paper_policy_sends_no_loans_or_warm_orders(tmp_path: Any) -> None:
    """Given tangram-dp (the paper's algorithm as written), idle GPUs get no warm order."""
    cfg = config(str(tmp_path), scheduler={"policy": "tangram-dp"}, apis=[])
    h = Harness(str(tmp_path), cfg=cfg)
    h.svc.start()
    h.svc.step(block_ms=None)
    assert _all(h, "tangram.gpu.g0") == []


def test_an_instance_the_load_outgrew_is_unloaded_while_its_chunk_is_idle(tmp_path: Any) -> None:
    """Given a 4-GPU node, three services and rm reported resident on all 4 GPUs (more than
    twice the one GPU each service's share allows), when the idle scheduler steps, then it
    sends an unload of that instance and drops it from its view, and warms each service on a
    GPU of its own; when the node answers that the instance is in use, it is not retired again
    at once."""
    models = [
        {"name": n, "backend": "hf-seq-cls", "path": "/m", "memory_mb": 1000, "dop_options": [1, 2, 4]}
        for n in ("rm", "sim", "third")
    ]
    cfg = config(
        str(tmp_path),
        nodes={"gpu": [{"name": "g0", "num_gpus": 4, "gpu_memory_mb": 4096}]},
        apis=[],
        reward_models=models,
        scheduler={"policy": "tangram-fast"},
    )
    h = Harness(str(tmp_path), cfg=cfg)
    h.svc.start()
    h.store.publish_residency("g0", {(0, 1, 2, 3): ["rm"]})
    h.svc.step(block_ms=None)
    orders = [GpuWarm.model_validate(args[0]) for _, args in _all(h, "tangram.gpu.g0")]
    assert [(o.op, o.service, o.chunk) for o in orders if o.op == "unload"] == [
        ("unload", "rm", (0, 1, 2, 3))
    ]
    loads = [o for o in orders if o.op == "load"]
    assert sorted(o.service for o in loads) == ["rm", "sim", "third"] and all(
        len(o.chunk) == 1 for o in loads
    )
    assert (0, 1, 2, 3) not in h.svc.state.gpu["g0"].resident
    h.store.publish_residency("g0", {(0, 1, 2, 3): ["rm"]})  # sent before the unload was done
    h.svc.step(block_ms=None)
    assert (0, 1, 2, 3) not in h.svc.state.gpu["g0"].resident
    unload = next(o for o in orders if o.op == "unload")
    h.store.publish_residency("g0", {(0, 1, 2, 3): ["rm"]}, warm=unload, error="not unloaded: in use")
    h.svc.step(block_ms=None)
    assert h.svc.state.gpu["g0"].resident[(0, 1, 2, 3)] == ["rm"]
    again = [GpuWarm.model_validate(args[0]) for _, args in _all(h, "tangram.gpu.g0")]
    assert not [o for o in again if o.op == "unload"], "a failed retirement is not sent again at once"
