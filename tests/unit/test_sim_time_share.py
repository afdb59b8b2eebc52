"""The simulator's time sharing (scheduler.sim.shared_cores): a sharer and its host split a
core by CFS weight per core, at their true duration curves, and the core is free when the last
of them ends. Hand-worked on one 4-core node: the host is perfectly parallel (its speed-up on
r cores is r), the sharer's sandbox has weight 0.25, so beside a 4-core host (1/4 per core) it
gets half the core and the host 3.5 cores' worth."""

from __future__ import annotations

import pytest

from scheduler.duration import Amdahl
from scheduler.estimator import DurationEstimator
from scheduler.execution import TimeShareSpec
from scheduler.model import ResourceKind
from scheduler.policies import get_policy
from scheduler.sim.engine import Simulator
from scheduler.sim.scenarios import Scenario
from scheduler.sim.shared_cores import SharedCores
from scheduler.sim.workload import SimAction, SimTrajectory, Step
from tests.fixtures.sim import one_node

CPU = ResourceKind.CPU
SPEC = TimeShareSpec(max_holder_loss=0.5)  # a 4-core host may give up to 2 cores' worth


def _scenario(host_t1_s: float, sharer_at_s: float, sharer_t1_s: float, sharers: int = 1) -> Scenario:
    host = SimAction("wide", CPU, (4,), host_t1_s, Amdahl(1.0))
    trajs = [SimTrajectory("h", 0.0, (Step(0.0, host),))]
    for i in range(sharers):
        short = SimAction("code", CPU, (1,), sharer_t1_s)
        trajs.append(SimTrajectory(f"s{i}", sharer_at_s, (Step(0.0, short),)))
    return one_node("share", trajs, cores=4)


def _estimator() -> DurationEstimator:
    """'code' measured at 1 s on one core (5 runs): short enough to share."""
    est = DurationEstimator()
    for _ in range(5):
        est.observe("code", 1, 1.0)
    return est


def _run(sc: Scenario, share: TimeShareSpec | bool = SPEC) -> dict[str, tuple[float, float, float]]:
    sim = Simulator(
        sc, get_policy("tangram-fast", share=share), estimator=_estimator(), check_invariants=True
    )
    res = sim.run()
    assert res.unfinished == 0
    (node,) = sim.state.cpu.values()
    assert not node.sharers and not node.vacated
    assert node.free == {0, 1, 2, 3}
    return {r.trajectory_id: (r.started_s, r.ended_s, r.slowed_s) for r in res.records}


def test_a_sharer_and_its_host_split_the_core_by_weight() -> None:
    """Host: 40 s of work on 4 cores (10 s alone). At t = 1 a 1 s action shares one of its cores
    at half speed: it ends at t = 3 (slowed 1 s). The host runs 3.5 cores' worth meanwhile, so
    it ends at 10.25 s: slowed by the sharer's second of work spread over its 4 cores."""
    out = _run(_scenario(40.0, 1.0, 1.0))
    assert out["s0"] == pytest.approx((1.0, 3.0, 1.0))
    assert out["h"] == pytest.approx((0.0, 10.25, 0.25))


def test_a_sharer_has_the_core_to_itself_once_its_host_ends() -> None:
    """Host: 4 s of work (1 s alone). A 2 s action joins at t = 0.5: the host, at 3.5 cores'
    worth, ends at 0.5 + 0.5 * 4 / 3.5; the sharer did a quarter of that at half a core, and
    runs the rest alone on the core, which stays held (not free) until it ends."""
    host_end = 0.5 + 0.5 * 4 / 3.5
    done = (host_end - 0.5) * 0.5 / 2.0
    out = _run(_scenario(4.0, 0.5, 2.0))
    assert out["h"][1] == pytest.approx(host_end)
    assert out["s0"][1] == pytest.approx(host_end + (1 - done) * 2.0)


def test_without_sharing_the_short_action_waits_for_the_host() -> None:
    """With sharing off, the same short action waits for the 4-core host to end (at 10 s)."""
    out = _run(_scenario(40.0, 1.0, 1.0), share=False)
    assert out["s0"] == pytest.approx((10.0, 11.0, 0.0))
    assert out["h"] == pytest.approx((0.0, 10.0, 0.0))


def test_two_sharers_on_two_cores_of_one_host() -> None:
    """Two 1 s actions join at t = 1 on two cores of the host (budget 2 cores' worth): each
    gets half a core, and the host 3 cores' worth; both end at 3, the host at 10.5."""
    out = _run(_scenario(40.0, 1.0, 1.0, sharers=2))
    assert out["s0"][:2] == pytest.approx((1.0, 3.0)) and out["s1"][:2] == pytest.approx((1.0, 3.0))
    assert out["h"][1] == pytest.approx(10.5)


def test_shared_cores_bookkeeping() -> None:
    """`SharedCores.worth`: a 4-core holder with one sharer keeps 3.5 cores' worth, the sharer
    gets 0.5; a loan to 8 cores makes the holder's weight per core 1/8, so the sharer gets
    2/3; when the holder leaves, the sharer has the core alone."""
    sc = SharedCores(TimeShareSpec())
    assert sc.join("s", "n", (0,), "h", 4) == {"h"}
    assert sc.worth("h", 4.0) == pytest.approx(3.5)
    assert sc.worth("s", 1.0) == pytest.approx(0.5)
    assert sc.reweigh("h", 8) == {"s"}
    assert sc.worth("s", 1.0) == pytest.approx(2 / 3)
    assert sc.leave("h") == {"s"}
    assert sc.worth("s", 1.0) == pytest.approx(1.0)
    assert sc.leave("s") == set()
    assert not sc.sharers and not sc.holder and not sc.cores and not sc.weight
