"""Malleable actions: spare cores lent to running test suites, taken back for queued actions."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler.duration import Amdahl
from scheduler.estimator import Prior
from scheduler.model import Allocation, CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.policies import get_policy
from scheduler.policies.malleable import Borrower, idle_while_malleable, lend_cores
from scheduler.pools import CpuNode
from scheduler.resources import ClusterState
from scheduler.sim import build
from scheduler.sim.cluster import ClusterSpec
from scheduler.sim.engine import Simulator
from scheduler.sim.scenarios import Scenario
from scheduler.sim.workload import SimAction, SimTrajectory, Step

CPU = ResourceKind.CPU


def _suite(aid: str, lo: int = 1, hi: int = 8, malleable: bool = True) -> QueuedAction:
    cost = CostVector(CPU, Elastic.range(lo, hi), memory_mb=0, malleable=malleable)
    return QueuedAction(aid, f"t-{aid}", cost, 0.0, t1_s=80.0, efficiency=Amdahl(0.95), kind="tests")


def _running(state: ClusterState, qa: QueuedAction, ids: tuple[int, ...]) -> Borrower:
    alloc = Allocation(qa.action_id, CPU, "n0", len(ids), ids)
    state.apply(alloc, qa, 0.0)
    return Borrower(qa, alloc)


def test_spare_cores_go_to_malleable_actions_up_to_their_largest_count() -> None:
    """Given two running suites (max 8 cores) on a 16-core node with 10 spare cores, when cores
    are lent, then both reach 8 cores, no core is lent twice and none stays idle."""
    state = ClusterState(cpu={"n0": CpuNode.uniform("n0", 16, 10_000)})
    a = _running(state, _suite("a"), (0, 1, 2))
    b = _running(state, _suite("b"), (3,))
    lent = lend_cores([a, b], {}, {}, state, 0.0)
    assert len(lent["a"][1]) == 5 and len(lent["b"][1]) == 7
    assert not lent["a"][1] & lent["b"][1]
    assert lent["a"][1] | lent["b"][1] <= state.cpu["n0"].free
    assert idle_while_malleable([a, b], lent, state) == []


def test_an_allocation_takes_its_lent_cores_back_first() -> None:
    """Given a suite holding every spare core on loan, when a round's allocation takes two of
    them, then the suite loses exactly those two and nothing else is lent."""
    state = ClusterState(cpu={"n0": CpuNode.uniform("n0", 8, 10_000)})
    a = _running(state, _suite("a"), (0, 1))
    lent = lend_cores([a], {}, {}, state, 0.0)
    assert lent["a"][1] == frozenset(range(2, 8))
    changed = lend_cores([a], lent, {"n0": {6, 7}}, state, 1.0)
    assert changed["a"][1] == frozenset(range(2, 6))


def test_rigid_and_fixed_dop_actions_get_no_loans() -> None:
    """Given a running `pytest -n K` run (elastic but not malleable), when cores are lent, then
    it gets none, and the invariant has nothing to flag."""
    state = ClusterState(cpu={"n0": CpuNode.uniform("n0", 8, 10_000)})
    a = _running(state, _suite("a", malleable=False), (0, 1))
    assert lend_cores([a], {}, {}, state, 0.0) == {}
    assert idle_while_malleable([a], {}, state) == []


def test_the_invariant_flags_an_idle_core_beside_a_malleable_action() -> None:
    """Given a suite below its largest count and free cores not lent, then the check names it."""
    state = ClusterState(cpu={"n0": CpuNode.uniform("n0", 8, 10_000)})
    a = _running(state, _suite("a"), (0, 1))
    bad = idle_while_malleable([a], {}, state)
    assert len(bad) == 1 and "a" in bad[0]


def _two_step_scenario() -> Scenario:
    """One 8-core node: a rigid 6-core job (10 s) holds most cores when a malleable suite
    arrives; the suite starts on the 2 free cores and should take the 6 back when it ends."""
    rigid = SimAction("build", CPU, (6,), 60.0, Amdahl(1.0))
    suite = SimAction("tests", CPU, tuple(range(1, 9)), 80.0, Amdahl(1.0), malleable=True)
    trajs = [
        SimTrajectory("r", 0.0, (Step(0.0, rigid),)),
        SimTrajectory("s", 0.0, (Step(0.5, suite),)),
    ]
    cluster = ClusterSpec(cpu_nodes=1, cores_per_node=8, numa_groups=1)
    priors = {"build": Prior(60.0, 1.0), "tests": Prior(80.0, 1.0)}
    sc = Scenario("two-step", trajs, cluster, priors)
    sc.exec_params = dataclasses.replace(sc.exec_params, sandbox_start_s=0.0, exec_overhead_s=0.0)
    return sc


def test_a_loan_speeds_up_the_work_left_by_the_duration_curve() -> None:
    """Given a suite started on 2 cores while 6 are busy for 10 s, when the 6 come back, then
    the suite runs its remaining work on 8 cores: 80 s of work ends at 10 + (80 - 2*9.5)/8 s."""
    sc = _two_step_scenario()
    res = Simulator(sc, get_policy("tangram-fast", defer=False), check_invariants=True).run()
    end = {r.trajectory_id: r.ended_s for r in res.records}
    assert end["r"] == pytest.approx(10.0)
    # 2 cores from 0.5 s to 10 s (19 core-seconds of 80), the rest on 8 cores
    assert end["s"] == pytest.approx(10.0 + (80.0 - 2 * 9.5) / 8)
    alone = Simulator(sc, get_policy("tangram-fast", defer=False, lend=False)).run()
    assert {r.trajectory_id: r.ended_s for r in alone.records}["s"] == pytest.approx(0.5 + 40.0)


def test_coding_simulation_conserves_work_and_completes() -> None:
    """Given a small contended coding run, when tangram-fast lends cores in debug mode, then
    the work-conservation check holds after every round and every action completes."""
    sc = build("coding", {"batch": 48}, cluster=ClusterSpec(cpu_nodes=1, cores_per_node=64))
    res = Simulator(sc, get_policy("tangram-fast"), check_invariants=True).run()
    assert res.unfinished == 0 and len(res.records) == sc.num_actions


def test_a_suite_of_test_cases_is_malleable_and_a_script_is_not() -> None:
    """Given code actions with cpus '1..8', when queued, then the one carrying test cases is
    malleable (its runner can take workers mid-run) and a plain script (`pytest -n K`) is not."""
    from scheduler.service.cluster import to_queued
    from tangram_celery.common.actions import CodeAction, TestCase
    from tangram_celery.common.config import TangramConfig
    from tangram_celery.common.wire import ActionMeta

    cfg = TangramConfig.model_validate({"nodes": {"cpu": [{"name": "n", "cores": 16, "memory_mb": 8192}]}})
    suite = CodeAction(
        id="s",
        trajectory_id="t",
        code="x = 1",
        cpus="1..8",
        test_cases=[TestCase(name="a", stdin="", expected_stdout="")],
    )
    script = CodeAction(id="p", trajectory_id="t", code="x = 1", cpus="1..8")
    one = CodeAction(id="o", trajectory_id="t", code="x = 1", cpus=1, test_cases=suite.test_cases)
    assert to_queued(ActionMeta.of(suite, 0.0), cfg).cost.malleable
    assert not to_queued(ActionMeta.of(script, 0.0), cfg).cost.malleable
    assert not to_queued(ActionMeta.of(one, 0.0), cfg).cost.malleable
