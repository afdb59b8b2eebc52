"""CPU riders: short actions queued behind an allocation on its cores (scheduler.policies.cpu_batch),
their state (`ClusterState.share` / `release` / `restore`) and their execution in the simulator."""

from __future__ import annotations

import pytest

from scheduler.model import Allocation, CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.policies import get_policy
from scheduler.policies.cpu_batch import CpuBatchSpec, cpu_riders, ending_batches
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState, CpuNode
from scheduler.round import Round
from scheduler.sim.engine import Simulator
from scheduler.sim.scenarios import Scenario
from scheduler.sim.workload import SimAction, SimTrajectory, Step
from tests.fixtures.sim import one_node

SPEC = CpuBatchSpec(max_actions=4, max_action_s=0.05, max_batch_s=0.2)


def _code(
    aid: str, tid: str | None = None, *, kind: str = "code", units: tuple[int, ...] = (1,), mb: int = 100
) -> QueuedAction:
    return QueuedAction(
        aid, tid or aid, CostVector(ResourceKind.CPU, Elastic(units), memory_mb=mb), 0.0, kind=kind
    )


def _measured(short: float = 0.01, long: float = 2.0) -> dict[str, float]:
    return {"code": short, "slow": long}


def _observed(table: dict[str, float]):  # type: ignore[no-untyped-def]
    return lambda qa, units: table.get(qa.kind)


def _plan(
    queue: list[QueuedAction],
    state: ClusterState,
    table: dict[str, float] | None = None,
    spec: CpuBatchSpec = SPEC,
):  # type: ignore[no-untyped-def]
    rnd = Round(
        get_policy("fcfs-min"), cpu_batch=spec, observed=_observed(_measured() if table is None else table)
    )
    return rnd.plan(WaitingQueue(queue), state, 1.0)


def test_short_actions_ride_behind_each_allocation_balanced_over_its_cores() -> None:
    """Given 2 free cores and 8 short waiting actions, 2 are allocated and the next 6 ride, 3
    behind each, alternating so that both batches end about together; nothing is changed."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 2, 10_000)})
    plan = _plan([_code(f"a{i}") for i in range(8)], state)
    assert [a.action_id for a in plan.allocs] == ["a0", "a1"]
    lead = {a.unit_ids: a.action_id for a in plan.allocs}
    behind = {lead[r.unit_ids]: [] for r in plan.riders}  # type: dict[str, list[str]]
    for r in plan.riders:
        behind[lead[r.unit_ids]].append(r.action_id)
    assert behind == {"a0": ["a2", "a4", "a6"], "a1": ["a3", "a5", "a7"]}
    assert state.cpu["n"].free == {0, 1} and not state.running


def test_nothing_rides_before_its_kind_was_measured_or_when_it_is_long() -> None:
    """Actions whose kind has no measurement yet, or measured longer than max_action_s, never
    ride (and neither do short actions behind them on the same node: FCFS)."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 1, 10_000)})
    assert not _plan([_code("a0"), _code("a1")], state, table={}).riders
    q = [_code("a0"), _code("s", kind="slow"), _code("a1")]
    assert not _plan(q, state).riders


def test_a_long_leader_takes_no_riders() -> None:
    """An allocation whose own kind is long gets no riders behind it."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 1, 10_000)})
    assert not _plan([_code("s", kind="slow"), _code("a1")], state).riders


def test_batches_respect_their_bounds() -> None:
    """A batch holds at most max_actions actions and max_batch_s of measured work."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 1, 10_000)})
    assert len(_plan([_code(f"a{i}") for i in range(10)], state).riders) == 3  # 4 in all
    wide = CpuBatchSpec(max_actions=100, max_action_s=0.05, max_batch_s=0.1)
    assert len(_plan([_code(f"a{i}") for i in range(10)], state, {"code": 0.03}, wide).riders) == 2


def test_a_trajectorys_next_action_follows_it_and_busy_ones_do_not_stop_the_walk() -> None:
    """A waiting action whose trajectory's previous action starts in a batch follows it there
    (in order); one whose trajectory runs elsewhere, pinned to a node with no batch, is
    skipped (it could not start here now), and short actions behind it still ride."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 1, 10_000), "m": CpuNode.uniform("m", 1, 10_000)})
    busy = _code("busy", "m-traj")
    state.apply(Allocation("busy", ResourceKind.CPU, "m", 1, (0,)), busy)
    q = [_code("a0", "t0"), _code("same", "t0"), _code("pinned-m", "m-traj"), _code("a1", "t1")]
    plan = _plan(q, state)
    assert [a.action_id for a in plan.allocs] == ["a0"]
    assert [(r.action_id, r.pool, r.unit_ids) for r in plan.riders] == [
        ("same", "n", (0,)),
        ("a1", "n", (0,)),
    ]


def test_wrong_unit_count_or_no_memory_closes_the_node() -> None:
    """An action that would run next on the node but accepts another unit count, or finds no
    memory even by evicting idle trajectories, stops the riders there: nothing overtakes it."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 1, 10_000)})
    assert not _plan([_code("a0"), _code("wide", units=(2,)), _code("a1")], state).riders
    small = ClusterState(cpu={"n": CpuNode.uniform("n", 1, 250)})
    plan = _plan([_code("a0"), _code("a1"), _code("big", mb=200), _code("a2")], small)
    assert [r.action_id for r in plan.riders] == ["a1"]


def test_an_action_handed_back_once_never_rides_and_nothing_overtakes_it() -> None:
    """Given a short action handed back from a batch once (`solo`), when it would ride next on
    the node, then it does not, and no later action rides past it there."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 1, 10_000)})
    back = _code("back")
    back.solo = True
    plan = _plan([_code("a0"), back, _code("a1")], state)
    assert [a.action_id for a in plan.allocs] == ["a0"] and not plan.riders
    plan = _plan([back, _code("a0"), _code("a1")], state)
    assert [a.action_id for a in plan.allocs] == ["back"]
    assert [r.action_id for r in plan.riders] == ["a0", "a1"]  # it leads a batch as any other


def test_a_rider_evicts_idle_trajectories_when_memory_is_short() -> None:
    """Given a node whose memory is held by idle trajectories, a rider of a new trajectory
    evicts the least recently used of them, and the plan names the eviction."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 1, 250)})
    for i, used in ((1, 5.0), (2, 3.0)):
        old = _code(f"old{i}", f"idle{i}")
        state.apply(Allocation(old.action_id, ResourceKind.CPU, "n", 1, (0,)), old, used)
        state.release(old.action_id, used)
    plan = _plan([_code("a0"), _code("a1")], state)
    assert plan.allocs[0].evict == ("idle2",)
    assert [(r.action_id, r.evict) for r in plan.riders] == [("a1", ("idle1",))]
    assert plan.evicted == {"idle2": "n", "idle1": "n"}


def test_shared_cores_come_back_with_the_last_of_the_batch_and_survive_a_restore() -> None:
    """Riders share their leader's core: it is freed when the last of them is released (in any
    order); riders pin their trajectories, expect to end after the ones ahead, and a state
    restored from the running allocations knows them as riders."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 2, 10_000)})
    lead, r1, r2 = _code("lead"), _code("r1"), _code("r2")
    state.apply(Allocation("lead", ResourceKind.CPU, "n", 1, (0,)), lead, 0.0)
    for qa in (r1, r2):
        state.share(Allocation(qa.action_id, ResourceKind.CPU, "n", 1, (0,)), qa, 0.0)
    assert state.trajectory_node["r2"] == "n" and state.cpu["n"].trajectory_memory_mb["r2"] == 100
    assert state.expected_end_s["r2"] == pytest.approx(3 * lead.duration_s(1))
    restored = ClusterState(cpu={"n": CpuNode.uniform("n", 2, 10_000)})
    restored.restore(state.to_dict())
    for s in (state, restored):
        assert s.cpu["n"].free == {1} and s.cpu["n"].riders == {(0,): 2}
        s.release("r1")
        s.release("lead")
        assert s.cpu["n"].free == {1}
        s.release("r2")
        assert s.cpu["n"].free == {0, 1} and not s.cpu["n"].riders
    with pytest.raises(ValueError, match="not held"):
        state.share(Allocation("x", ResourceKind.CPU, "n", 1, (0,)), _code("x"), 0.0)


def _batch_on(state: ClusterState, core: int, n: int, left: int, prefix: str = "c") -> None:
    """A batch of `n` short actions on `core` (a leader and its riders), all but `left` ended."""
    for i in range(n):
        qa = _code(f"{prefix}{i}")
        alloc = Allocation(qa.action_id, ResourceKind.CPU, "n", 1, (core,))
        (state.apply if i == 0 else state.share)(alloc, qa, 0.0)
    for i in range(n - left):
        state.release(f"{prefix}{i}", 0.5)


def test_a_batch_near_its_end_takes_the_next_riders_behind_it() -> None:
    """Given no free core and a batch with 2 actions left on it, a round allocates nothing and
    queues short waiting actions behind those 2, in FCFS order, until the batch holds
    max_actions (4) again; the riders apply to the state as riders of those cores. With 3 left,
    with `join_below` 0, or behind a long action at the head of the queue (FCFS), none."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 1, 10_000)})
    _batch_on(state, 0, 4, left=2)
    assert [(b.lead.unit_ids, b.size) for b in ending_batches(state, SPEC)] == [((0,), 2)]
    waiting = [_code(f"w{i}") for i in range(5)]
    plan = _plan(waiting, state)
    assert not plan.allocs
    assert [(r.action_id, r.unit_ids) for r in plan.riders] == [("w0", (0,)), ("w1", (0,))]
    for r in plan.riders:
        state.share(r, next(qa for qa in waiting if qa.action_id == r.action_id), 0.6)
    assert state.cpu["n"].riders == {(0,): 3} and not state.cpu["n"].free
    assert not ending_batches(state, SPEC)  # 4 left now
    off = CpuBatchSpec(max_actions=4, max_action_s=0.05, max_batch_s=0.2, join_below=0)
    fresh = ClusterState(cpu={"n": CpuNode.uniform("n", 1, 10_000)})
    _batch_on(fresh, 0, 4, left=2)
    assert not _plan(waiting, fresh, spec=off).riders
    assert not _plan([_code("s", kind="slow"), *waiting], fresh).riders
    three = ClusterState(cpu={"n": CpuNode.uniform("n", 1, 10_000)})
    _batch_on(three, 0, 4, left=3)
    assert not ending_batches(three, SPEC) and not _plan(waiting, three).riders


def test_at_the_end_of_a_burst_a_joining_batch_takes_only_its_share() -> None:
    """Given 2 busy cores, one batch with 2 actions left (it may take riders) and one with 6,
    and 6 short actions waiting (batches of up to 8): the first takes 5, so that both cores
    hold 7 once the last waiting action joins the other (without the share it took all 6: 8
    against 6, one core idle at the end for 2 actions). With a long queue the share does not
    bind: it takes riders up to 8."""
    spec = CpuBatchSpec(max_actions=8, max_action_s=0.05, max_batch_s=0.5)
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 2, 10_000)})
    _batch_on(state, 0, 8, left=2, prefix="c")
    _batch_on(state, 1, 8, left=6, prefix="d")
    assert [(b.lead.unit_ids, b.size) for b in ending_batches(state, spec)] == [((0,), 2)]
    plan = _plan([_code(f"w{i}") for i in range(6)], state, spec=spec)
    assert not plan.allocs
    assert [(r.action_id, r.unit_ids) for r in plan.riders] == [(f"w{i}", (0,)) for i in range(5)]
    long = _plan([_code(f"w{i}") for i in range(40)], state, spec=spec)
    assert [r.action_id for r in long.riders] == [f"w{i}" for i in range(6)]


def test_a_short_action_running_alone_takes_riders_behind_it() -> None:
    """The start of a burst: a round saw one short action and started it alone (on core 0).
    Given 8 short actions waiting at the next round and core 1 free, that round allocates one
    to core 1 and queues riders behind both, alternating, so that core 0 does not idle through
    a round, a message and a claim after its action ends. A long action running alone, one
    with a time sharer on its core, or one no round started as a short lead, takes none."""
    spec = CpuBatchSpec(max_actions=8, max_action_s=0.05, max_batch_s=0.5)
    rnd = Round(get_policy("fcfs-min"), cpu_batch=spec, observed=_observed(_measured()))
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 2, 10_000)})
    first = rnd.plan(WaitingQueue([_code("first")]), state, 1.0)
    assert [a.action_id for a in first.allocs] == ["first"] and not first.riders
    state.apply(first.allocs[0], _code("first"), 1.0)
    held = first.allocs[0].unit_ids
    waiting = [_code(f"w{i}") for i in range(8)]
    plan = rnd.plan(WaitingQueue(waiting), state, 1.002)
    assert [a.action_id for a in plan.allocs] == ["w0"] and plan.allocs[0].unit_ids != held
    behind = {
        c: [r.action_id for r in plan.riders if r.unit_ids == c] for c in (held, plan.allocs[0].unit_ids)
    }
    assert behind == {held: ["w1", "w3", "w5", "w7"], plan.allocs[0].unit_ids: ["w2", "w4", "w6"]}
    for a in [*plan.allocs, *plan.riders]:  # the riders apply as riders of their cores
        state.hold(a, next(qa for qa in waiting if qa.action_id == a.action_id), 1.002)
    assert state.cpu["n"].riders == {held: 4, plan.allocs[0].unit_ids: 3}
    # what ending_batches makes of a lone action, by what `short` says of it
    lone = ClusterState(cpu={"n": CpuNode.uniform("n", 2, 10_000)})
    lone.apply(Allocation("x", ResourceKind.CPU, "n", 1, (0,)), _code("x"), 1.0)
    assert [(b.lead.action_id, b.size) for b in ending_batches(lone, spec, ["x"])] == [("x", 1)]
    assert not ending_batches(lone, spec, [])  # not a short lead (a long kind)
    assert not ending_batches(lone, spec)
    lone.share_cores(Allocation("s", ResourceKind.CPU, "n", 1, (0,), shares=True), _code("s"), 1.0)
    assert not ending_batches(lone, spec, ["x"])  # a time sharer beside it
    slow = Round(get_policy("fcfs-min"), cpu_batch=spec, observed=_observed(_measured()))
    busy = ClusterState(cpu={"n": CpuNode.uniform("n", 2, 10_000)})
    s0 = slow.plan(WaitingQueue([_code("long", kind="slow")]), busy, 1.0)
    busy.apply(s0.allocs[0], _code("long", kind="slow"), 1.0)
    s1 = slow.plan(WaitingQueue(waiting), busy, 1.002)
    assert all(r.unit_ids != s0.allocs[0].unit_ids for r in s1.riders)


def test_a_batch_near_its_end_on_an_offline_node_takes_no_riders() -> None:
    """A node that went offline takes nothing new, behind a batch either."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 1, 10_000)})
    _batch_on(state, 0, 4, left=2)
    state.set_offline({"cpu:n"})
    assert not ending_batches(state, SPEC)


def test_the_simulator_queues_riders_behind_batches_near_their_end() -> None:
    """A burst of short actions on 2 cores, with riders joining batches near their end and
    without: every action finishes, never two at once on a core, in the same total time (the
    simulator charges nothing for a dispatch, which the live service saves)."""
    off = CpuBatchSpec(max_actions=4, max_action_s=0.05, max_batch_s=0.2, join_below=0)
    results = [
        Simulator(_burst(60, 0.01), get_policy("tangram-fast"), cpu_batch=spec).run() for spec in (SPEC, off)
    ]
    for res in results:
        assert res.unfinished == 0 and len(res.records) == 60
        spans = sorted((r.started_s, r.ended_s) for r in res.records)
        for t in {s for s, _ in spans}:
            assert sum(1 for s, e in spans if s <= t < e) <= 2
    assert results[0].makespan_s == pytest.approx(results[1].makespan_s)


def test_cpu_riders_needs_no_round() -> None:
    """The pure function alone: no CPU allocation, no riders."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 1, 10_000)})
    q = WaitingQueue([_code("a0")])
    assert cpu_riders([], q, q, state, SPEC, _observed(_measured()), 0.0) == []


def _burst(n: int, dur_s: float) -> Scenario:
    trajs = [
        SimTrajectory(
            f"t{i}", 0.0, (Step(0.0, SimAction("code", ResourceKind.CPU, (1,), dur_s, memory_mb=100)),)
        )
        for i in range(n)
    ]
    return one_node("burst", trajs, cores=2)


def test_the_simulator_runs_riders_one_after_another_on_their_leaders_cores() -> None:
    """A burst of short actions on 2 cores: with batching on, riders start exactly when the
    action before them on the same core ends (never two at once on a core), every action
    finishes, and the total work takes the same time as without batching."""
    plain = Simulator(_burst(40, 0.01), get_policy("tangram-fast")).run()
    batched = Simulator(_burst(40, 0.01), get_policy("tangram-fast"), cpu_batch=SPEC).run()
    assert plain.unfinished == 0 and batched.unfinished == 0
    assert batched.makespan_s == pytest.approx(plain.makespan_s)
    spans = sorted((r.started_s, r.ended_s) for r in batched.records)
    for t in {s for s, _ in spans}:
        assert sum(1 for s, e in spans if s <= t < e) <= 2
    assert len(batched.records) == 40


def test_a_trajectory_runs_one_action_at_a_time_in_its_sandbox() -> None:
    """Given two free cores and two queued actions of one trajectory, only the first is
    allocated (the second would wait for the sandbox on a core of its own) and, once measured
    short, the second rides behind it; a trajectory with a CPU action running gets no
    allocation, one with only a GPU action running does."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 2, 10_000)})
    plan = _plan([_code("a", "t"), _code("b", "t")], state, table={})
    assert [a.action_id for a in plan.allocs] == ["a"] and not plan.riders
    plan = _plan([_code("a", "t"), _code("b", "t")], state)
    assert [a.action_id for a in plan.allocs] == ["a"]
    assert [(r.action_id, r.unit_ids) for r in plan.riders] == [("b", plan.allocs[0].unit_ids)]
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 3, 10_000)})
    state.apply(Allocation("run", ResourceKind.CPU, "n", 1, (0,)), _code("run", "busy"))
    gpu = QueuedAction("g", "gpu-busy", CostVector(ResourceKind.GPU), 0.0)
    state.running["g"] = Allocation("g", ResourceKind.GPU, "x", 1, (0,))
    state.running_trajectory["g"] = "gpu-busy"
    state.trajectory_running["gpu-busy"] = 1
    assert gpu.trajectory_id in state.trajectory_running
    plan = _plan([_code("c", "busy"), _code("d", "gpu-busy")], state, table={})
    assert [a.action_id for a in plan.allocs] == ["d"]
