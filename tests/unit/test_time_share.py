"""Bounded time sharing (scheduler.policies.time_share): who shares which held cores, the
state's books of shared cores (`ClusterState.share_cores` / `release` / `restore`), and what
the estimates read of them. Hand-worked cases with the default bounds: a sharer's sandbox at
weight 0.25, at least half of each core, a host giving at most 1/8 of its cores' worth."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from scheduler.duration import Amdahl
from scheduler.execution import TimeShareSpec
from scheduler.model import Allocation, CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.policies import TangramFast
from scheduler.policies.common import busy_by_pool
from scheduler.policies.time_share import core_share, narrowest_host, oversubscribed
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState, CpuNode
from scheduler.round import Round, RoundPlan

CPU = ResourceKind.CPU


def _qa(
    aid: str, tid: str | None = None, *, kind: str = "code", units: tuple[int, ...] = (1,), mb: int = 100
) -> QueuedAction:
    curve = Amdahl(0.9) if len(units) > 1 else Amdahl(0.0)
    return QueuedAction(
        aid,
        tid or aid,
        CostVector(CPU, Elastic(units), memory_mb=mb),
        0.0,
        t1_s=1.0,
        efficiency=curve,
        kind=kind,
    )


def _observed(table: dict[str, float]) -> Callable[[QueuedAction, int], float | None]:
    return lambda qa, units: table.get(qa.kind)


MEASURED = {"code": 1.0, "slow": 30.0}


def _state(cores: int = 16, memory_mb: int = 100_000, groups: int = 1) -> ClusterState:
    return ClusterState(cpu={"n": CpuNode.uniform("n", cores, memory_mb, groups)})


def _hold(state: ClusterState, aid: str, cores: tuple[int, ...], end_s: float = 100.0) -> None:
    """A running exclusive action `aid` on `cores` (its own trajectory), expected to end at `end_s`."""
    state.apply(Allocation(aid, CPU, "n", len(cores), cores), _qa(aid, units=(len(cores),)), 0.0)
    state.expected_end_s[aid] = end_s


def _plan(
    queue: list[QueuedAction],
    state: ClusterState,
    spec: TimeShareSpec | None = None,
    table: dict[str, float] | None = None,
) -> RoundPlan:
    policy = TangramFast(share=spec or TimeShareSpec())
    rnd = Round(policy, observed=_observed(MEASURED if table is None else table))
    return rnd.plan(WaitingQueue(queue), state, 1.0)


def test_core_share_splits_a_core_by_weight_per_core() -> None:
    """A sharer of weight 0.25 beside a host on 8 cores (1/8 per core) gets two thirds of the
    core, beside a 1-core host a fifth; alone it gets all of it."""
    assert core_share(0.25, 1 / 8) == pytest.approx(2 / 3)
    assert core_share(0.25, 1.0) == pytest.approx(0.2)
    assert core_share(0.25, 0.0) == 1.0
    assert core_share(0.25, 1 / 8, [0.25]) == pytest.approx(0.25 / 0.625)


def test_the_narrowest_host_the_bounds_allow() -> None:
    """With the defaults a host needs 4 cores (a sharer gets half of a core of a 4-core host,
    the most it may give); the 2-core local config's bounds let a 1-core action host; bounds
    no host meets give more cores than any node has."""
    assert narrowest_host(TimeShareSpec()) == 4
    assert narrowest_host(TimeShareSpec(weight=1.0, min_share=0.4, max_holder_loss=0.75, per_core=2)) == 1
    assert narrowest_host(TimeShareSpec(min_share=1.0), most=64) == 65


def test_a_short_rigid_action_shares_a_wide_host_within_its_loss_budget() -> None:
    """Given every core held (an 8-core action, 8 single-core ones) and three short measured
    actions waiting: the first shares the 8-core host's first core (it gets 2/3 of it, the
    host loses 2/3 of a core of its 1-core budget); the second would take the host past its
    budget and the narrow hosts give it a fifth of a core, so it and the one behind it wait.
    Nothing is changed by the round."""
    state = _state()
    _hold(state, "suite", tuple(range(8)))
    for c in range(8, 16):
        _hold(state, f"sh{c}", (c,))
    plan = _plan([_qa("a"), _qa("b"), _qa("c")], state)
    assert plan.allocs == []
    assert [(s.action_id, s.unit_ids, s.shares) for s in plan.sharers] == [("a", (0,), True)]
    assert state.cpu["n"].sharers == {} and "a" not in state.running


def test_the_host_where_the_sharer_gets_most_then_the_longest() -> None:
    """Given hosts of 4, 16 and 16 cores (the last two expected to end at 50 s and 90 s): a
    sharer goes to the 16-core host that runs longest; a 4-core host gives exactly half a core
    (the least a sharer takes) and may host one (its budget is half a core)."""
    state = _state(40)
    _hold(state, "w4", (0, 1, 2, 3))
    _hold(state, "w16a", tuple(range(4, 20)), end_s=50.0)
    _hold(state, "w16b", tuple(range(20, 36)), end_s=90.0)
    _hold(state, "rest", (36, 37, 38, 39))
    plan = _plan([_qa("a")], state)
    assert [(s.action_id, s.unit_ids) for s in plan.sharers] == [("a", (20,))]
    state = _state(4)
    _hold(state, "w4", (0, 1, 2, 3))
    plan = _plan([_qa("a"), _qa("b")], state)
    assert [(s.action_id, s.unit_ids) for s in plan.sharers] == [("a", (0,))]


def test_who_shares_and_who_waits_for_cores_of_its_own() -> None:
    """Only rigid actions whose kind was measured short share: a kind measured long, a kind
    never measured and an elastic action wait for cores of their own, and do not hold back a
    short one behind them (sharers take no core they wait for). An action whose trajectory
    runs something waits for its sandbox."""
    state = _state()
    _hold(state, "suite", tuple(range(16)))
    queue = [
        _qa("long", kind="slow"),
        _qa("new", kind="unmeasured"),
        _qa("elastic", units=(1, 2, 3, 4)),
        _qa("busy", "suite"),
        _qa("short"),
    ]
    plan = _plan(queue, state)
    assert [s.action_id for s in plan.sharers] == ["short"]


def test_free_cores_stay_for_the_head_of_the_queue() -> None:
    """Given 8 held cores and 8 free ones, and a head that needs all 16 (it waits): the short
    action behind it shares a held core; none of the free cores is taken."""
    state = _state()
    _hold(state, "suite", tuple(range(8)))
    plan = _plan([_qa("head", kind="slow", units=(16,)), _qa("short")], state)
    assert plan.allocs == []
    assert [(s.action_id, s.unit_ids) for s in plan.sharers] == [("short", (0,))]


def test_fcfs_among_sharers_and_the_cap_per_core() -> None:
    """With a budget for many sharers (max_holder_loss 0.9) and one sharer per core, a 4-core
    host takes four; the fifth waits, and so does the sixth behind it (no overtaking among
    sharers on a node with no room), while a sharer pinned to another node still shares there."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 4, 100_000), "m": CpuNode.uniform("m", 4, 100_000)})
    _hold(state, "h", (0, 1, 2, 3))
    state.apply(Allocation("hm", CPU, "m", 4, (0, 1, 2, 3)), _qa("hm", units=(4,)), 0.0)
    pinned = _qa("pm", "tm")
    state.trajectory_node["tm"] = "m"
    state.cpu["m"].trajectory_memory_mb["tm"] = 100
    spec = TimeShareSpec(max_holder_loss=0.9)
    queue = [_qa(f"s{i}", f"t{i}") for i in range(6)]
    for i in range(6):  # all pinned to n
        state.trajectory_node[f"t{i}"] = "n"
        state.cpu["n"].trajectory_memory_mb[f"t{i}"] = 100
    plan = _plan([*queue, pinned], state, spec)
    assert [(s.action_id, s.pool, s.unit_ids) for s in plan.sharers] == [
        ("s0", "n", (0,)),
        ("s1", "n", (1,)),
        ("s2", "n", (2,)),
        ("s3", "n", (3,)),
        ("pm", "m", (0,)),
    ]


def test_a_sharer_reserves_memory_evicting_idle_trajectories() -> None:
    """A sharer of a new trajectory needs its memory: on a node whose memory is held by an
    idle trajectory it evicts it; with no memory to be had it waits and so do later new
    trajectories' sharers, while a pinned trajectory's sharer (its memory is reserved) shares."""
    state = _state(memory_mb=1000)
    _hold(state, "suite", tuple(range(16)))
    state.trajectory_node["idle"] = "n"
    state.cpu["n"].trajectory_memory_mb["idle"] = 900
    plan = _plan([_qa("a", mb=500)], state)
    assert [(s.action_id, s.evict) for s in plan.sharers] == [("a", ("idle",))]
    assert plan.evicted == {"idle": "n"}
    state = _state(memory_mb=1000)
    _hold(state, "suite", tuple(range(16)))
    state.trajectory_node["p"] = "n"
    state.cpu["n"].trajectory_memory_mb["p"] = 1000
    plan = _plan(
        [_qa("big", mb=500), _qa("new", mb=500), _qa("pinned", "p", mb=100)],
        state,
        TimeShareSpec(max_holder_loss=0.5),
    )
    assert [s.action_id for s in plan.sharers] == ["pinned"]


def test_state_books_a_shared_core_until_its_last_tenant_ends() -> None:
    """`share_cores` keeps a held core held: released by the holder first it is vacated (not
    free, and the estimate sees it back when its sharer ends); released by its sharer last it
    is free. A sharer on a free core is refused, the bounds check finds nothing wrong, and a
    restart rebuilds the same books from a snapshot listing the sharer first."""
    state = _state(4)
    _hold(state, "h", (0, 1, 2, 3), end_s=10.0)
    s = Allocation("s", CPU, "n", 1, (1,), shares=True)
    state.share_cores(s, _qa("s", mb=100), 0.0)
    node = state.cpu["n"]
    assert node.sharers == {1: 1} and state.trajectory_node["s"] == "n" and "s" in state.shared
    snap = state.to_dict()
    snap["running"].reverse()
    again = _state(4)
    again.restore(snap)
    assert again.cpu["n"].sharers == {1: 1} and not again.cpu["n"].free
    state.expected_end_s["s"] = 20.0
    state.release("h", 5.0)
    assert node.free == {0, 2, 3} and node.vacated == {1}
    assert busy_by_pool(state, 5.0)[("cpu", "n", 0)] == [(20.0, 1)]
    assert oversubscribed(state, TimeShareSpec()) == []
    snap = state.to_dict()
    again = _state(4)
    again.restore(snap)
    assert again.cpu["n"].vacated == {1} and again.cpu["n"].free == {0, 2, 3}
    state.release("s", 6.0)
    assert node.free == {0, 1, 2, 3} and not node.vacated and not node.sharers
    with pytest.raises(ValueError, match="not held"):
        state.share_cores(Allocation("x", CPU, "n", 1, (0,), shares=True), _qa("x"), 7.0)
    node.sharers[0] = 2
    assert oversubscribed(state, TimeShareSpec()) != []


def test_a_sharer_ending_first_leaves_the_core_to_its_holder() -> None:
    """Released by its sharer first, a shared core stays its holder's; the holder's release
    then frees every core."""
    state = _state(2)
    _hold(state, "h", (0, 1))
    state.share_cores(Allocation("s", CPU, "n", 1, (0,), shares=True), _qa("s"), 0.0)
    state.release("s", 1.0)
    assert not state.cpu["n"].free and not state.cpu["n"].sharers
    state.release("h", 2.0)
    assert state.cpu["n"].free == {0, 1}


def test_tangram_dp_and_switched_off_fast_never_share() -> None:
    """`tangram-dp` is the paper's algorithm: its execution model has no time sharing; neither
    has `tangram-fast` with `share=False`; the default `tangram-fast` shares."""
    from scheduler.policies import get_policy

    assert get_policy("tangram-dp").execution.time_share is None
    assert get_policy("tangram-fast", share=False).execution.time_share is None
    assert get_policy("tangram-fast").execution.time_share == TimeShareSpec()
    state = _state()
    _hold(state, "suite", tuple(range(16)))
    rnd = Round(get_policy("tangram-dp"), observed=_observed(MEASURED))
    assert rnd.plan(WaitingQueue([_qa("a")]), state, 1.0).sharers == []
