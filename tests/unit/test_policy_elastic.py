"""tangram-dp and tangram-fast on small hand-worked cases."""

from __future__ import annotations

import pytest

from scheduler.duration import Amdahl, Rigid
from scheduler.model import Allocation, CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.policies import TangramFast, get_policy
from scheduler.resources import ClusterState, CpuNode, GpuNode

ELASTIC = ["tangram-dp", "tangram-fast"]


def cpu_action(aid: str, lo: int = 1, hi: int = 1, t1_s: float = 10.0, p: float = 1.0) -> QueuedAction:
    curve = Amdahl(p) if hi > lo else Rigid()
    cost = CostVector(ResourceKind.CPU, Elastic.range(lo, hi), memory_mb=1)
    return QueuedAction(aid, f"traj-{aid}", cost, 0.0, t1_s=t1_s, efficiency=curve, kind="k")


def one_node(cores: int, groups: int = 1) -> ClusterState:
    return ClusterState(cpu={"n0": CpuNode.uniform("n0", cores, 10_000, groups)})


def apply_all(state: ClusterState, queue: list[QueuedAction], allocs: list[Allocation]) -> None:
    by_id = {a.action_id: a for a in queue}
    for alloc in allocs:
        state.apply(alloc, by_id[alloc.action_id])


@pytest.mark.parametrize("name", ELASTIC)
def test_two_perfectly_elastic_actions_split_the_cores_evenly(name: str) -> None:
    """Given 8 free cores and two equal p=1 actions, when decided, then each gets 4 cores."""
    queue = [cpu_action("a", 1, 8, 40.0), cpu_action("b", 1, 8, 40.0)]
    allocs = get_policy(name).decide(queue, one_node(8), 0.0)
    assert sorted(a.units for a in allocs) == [4, 4]


@pytest.mark.parametrize("name", ELASTIC)
def test_longer_action_gets_more_cores(name: str) -> None:
    """Given 6 cores, T1 = 90 s and 10 s (p=1), when decided, then the split is 4/2 or better.

    Sum of durations 90/m + 10/(6-m) is smallest at m = 4 (22.5 + 5 = 27.5 s; m=5 gives 28).
    """
    queue = [cpu_action("long", 1, 6, 90.0), cpu_action("short", 1, 6, 10.0)]
    policy = TangramFast(defer=False) if name == "tangram-fast" else get_policy(name)
    allocs = {a.action_id: a.units for a in policy.decide(queue, one_node(6), 0.0)}
    assert allocs == {"long": 4, "short": 2}


def test_fast_defers_the_long_action_when_waiting_for_the_short_ones_cores_is_better() -> None:
    """Given 6 cores, a rigid 4-core 5 s action first in line and a 90 s p=1 action behind it:
    without deferral "long" starts on the 2 spare cores and ends at 45 s; tangram-fast (whose
    default is to defer) makes it wait for all 6 cores at 5 s, ending at 5 + 90/6 = 20 s, and
    delays nobody (reservations are only for at least twice the cores it would get now)."""
    queue = [cpu_action("short", 4, 4, 5.0), cpu_action("long", 1, 6, 90.0)]
    eager = {a.action_id: a.units for a in TangramFast(defer=False).decide(queue, one_node(6), 0.0)}
    assert eager == {"short": 4, "long": 2}
    allocs = {a.action_id: a.units for a in get_policy("tangram-fast").decide(queue, one_node(6), 0.0)}
    assert allocs == {"short": 4}


def busy_node(cores: int, held: int, end_s: float) -> ClusterState:
    """A node with `held` cores running one rigid action expected to end at `end_s`."""
    state = one_node(cores)
    holder = cpu_action("holder", held, held, end_s)
    state.apply(Allocation("holder", ResourceKind.CPU, "n0", held, tuple(range(held))), holder)
    return state


def test_fast_makes_a_test_suite_wait_seconds_for_32_cores_instead_of_minutes_on_4() -> None:
    """Given 4 free cores of 32, 28 held until t = 2 s, and a 300 s suite (p = 0.97):
    now on 4 cores it takes 300 * (0.03 + 0.97/4) = 81.8 s; at 2 s on 32 cores it ends at
    2 + 18.1 = 20.1 s. So it waits; a 1 s rigid action behind it backfills (ends before 2 s)."""
    queue = [cpu_action("suite", 1, 32, 300.0, p=0.97), cpu_action("ls", 1, 1, 1.0)]
    allocs = {
        a.action_id: a.units for a in get_policy("tangram-fast").decide(queue, busy_node(32, 28, 2.0), 0.0)
    }
    assert allocs == {"ls": 1}


def test_fast_weighs_the_suites_gain_against_the_delay_it_causes_behind_it() -> None:
    """Same 4 free cores of 32. Waiting gains the suite 81.8 - 20.1 = 61.7 s. With one 10 s
    command behind it (delayed by at most 2 s) it waits; with 40 of them (up to 80 s of delay
    in all) it starts now."""
    suite = cpu_action("suite", 1, 32, 300.0, p=0.97)
    few = [suite, cpu_action("cmd0", 1, 1, 10.0)]
    allocs = {a.action_id for a in get_policy("tangram-fast").decide(few, busy_node(32, 28, 2.0), 0.0)}
    assert "suite" not in allocs
    many = [suite] + [cpu_action(f"cmd{k}", 1, 1, 10.0) for k in range(40)]
    allocs = {a.action_id for a in get_policy("tangram-fast").decide(many, busy_node(32, 28, 2.0), 0.0)}
    assert "suite" in allocs


def test_fast_reserves_and_lets_an_action_behind_use_the_cores_spare_at_the_reservation() -> None:
    """With 36 cores (28 held until 2 s, 8 free), 36 are free at 2 s: 32 for the suite and 4
    spare, so the 10 s build behind it starts now and the suite waits for its 32 cores."""
    queue = [cpu_action("suite", 1, 32, 300.0, p=0.97), cpu_action("build", 4, 4, 10.0)]
    allocs = {
        a.action_id: a.units for a in get_policy("tangram-fast").decide(queue, busy_node(36, 28, 2.0), 0.0)
    }
    assert allocs == {"build": 4}


def test_fast_does_not_wait_for_actions_that_are_already_overdue() -> None:
    """An action past its expected end may run for any time yet: the suite does not bet on it."""
    queue = [cpu_action("suite", 1, 32, 300.0, p=0.97)]
    state = busy_node(32, 28, 2.0)
    allocs = {a.action_id: a.units for a in get_policy("tangram-fast").decide(queue, state, 5.0)}
    assert allocs == {"suite": 4}


@pytest.mark.parametrize("name", ELASTIC)
def test_drop_tail_gives_a_rigid_tail_candidates_core_to_a_long_elastic_action(name: str) -> None:
    """Given 2 free cores, a core freeing at 0.5 s, a 100 s elastic action and a 1 s rigid one,
    when decided, then the rigid one waits (ACT 1.5 s) and the elastic one runs on 2 cores.

    Keep both: 100 + 1 = 101 s. Drop the rigid one: 50 + (0.5 + 1) = 51.5 s.
    """
    state = one_node(3)
    blocker = cpu_action("x", t1_s=0.5)
    state.apply(Allocation("x", ResourceKind.CPU, "n0", 1, (2,)), blocker, 0.0)
    queue = [cpu_action("big", 1, 2, 100.0), cpu_action("small", 1, 1, 1.0)]
    allocs = get_policy(name).decide(queue, state, 0.0)
    assert [(a.action_id, a.units) for a in allocs] == [("big", 2)]


@pytest.mark.parametrize("name", ELASTIC)
def test_rigid_actions_start_at_their_minimum_in_fcfs_order(name: str) -> None:
    """Given 3 cores and 4 rigid actions, when decided, then the first 3 start at 1 core."""
    queue = [cpu_action(str(i)) for i in range(4)]
    allocs = get_policy(name).decide(queue, one_node(3), 0.0)
    assert [(a.action_id, a.units) for a in allocs] == [("0", 1), ("1", 1), ("2", 1)]


@pytest.mark.parametrize("name", ELASTIC)
def test_decide_does_not_mutate_the_state_and_its_allocations_apply(name: str) -> None:
    """Given a mixed queue over two NUMA groups, when decided, then the state is untouched and
    every allocation applies in order, elastic ones within one NUMA group."""
    state = one_node(16, groups=2)
    queue = [cpu_action(f"e{i}", 1, 8, 30.0 + i, 0.9) for i in range(3)] + [cpu_action("r")]
    before = state.to_dict(), {n: set(c.free) for n, c in state.cpu.items()}
    allocs = get_policy(name).decide(queue, state, 0.0)
    assert (state.to_dict(), {n: set(c.free) for n, c in state.cpu.items()}) == before
    apply_all(state, queue, allocs)
    for a in allocs:
        assert {c // 8 for c in a.unit_ids} == {a.unit_ids[0] // 8}


@pytest.mark.parametrize("name", ELASTIC)
def test_gpu_actions_get_aligned_buddy_chunks(name: str) -> None:
    """Given an empty 8-GPU node and two GPU actions, when decided, then chunks are aligned 4+4."""
    state = ClusterState(gpu={"g0": GpuNode("g0", 8, 80_000)})
    queue = [
        QueuedAction(
            f"r{i}",
            f"t{i}",
            CostVector(ResourceKind.GPU, Elastic((1, 2, 4, 8))),
            0.0,
            t1_s=10.0,
            efficiency=Amdahl(1.0),
            kind="reward:m",
            target="m",
        )
        for i in range(2)
    ]
    allocs = get_policy(name).decide(queue, state, 0.0)
    assert sorted(a.unit_ids for a in allocs) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    apply_all(state, queue, allocs)


def test_fast_prefers_a_chunk_where_the_service_is_resident() -> None:
    """Given service m resident on GPUs (4,5), when one call is decided, then it goes there."""
    state = ClusterState(gpu={"g0": GpuNode("g0", 8, 80_000)})
    state.gpu["g0"].free = {0, 1, 4, 5}
    state.gpu["g0"].resident = {(4, 5): ["m"]}
    qa = QueuedAction(
        "r",
        "t",
        CostVector(ResourceKind.GPU, Elastic((1, 2, 4, 8))),
        0.0,
        t1_s=1.0,
        kind="reward:m",
        target="m",
    )
    allocs = get_policy("tangram-fast").decide([qa], state, 0.0)
    assert [a.unit_ids for a in allocs] == [(4, 5)]
