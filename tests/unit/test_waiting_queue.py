"""`WaitingQueue`: a FCFS sequence whose index gives the same rest distribution as a list.

The elastic round assigns every queued non-candidate action to a pool (`distribute_rest`). Over
a `WaitingQueue` it reads only the actions routed to the pools' nodes; these tests drive a
queue and a plain list through the same random history (appends, starts, new pins, closed
trajectories, restored state) and check that every round's distribution is identical.
"""

from __future__ import annotations

import random

import pytest

from scheduler.model import CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.policies.common import PoolKey, distribute_rest
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState, CpuNode, GpuNode

NODES = ["n0", "n1", "n2", "n3"]


def _state() -> ClusterState:
    return ClusterState(
        cpu={n: CpuNode.uniform(n, 8, 1 << 20, 2) for n in NODES},
        gpu={"g0": GpuNode("g0", 8, 80_000), "g1": GpuNode("g1", 8, 80_000)},
    )


def _action(i: int, traj: str, rng: random.Random) -> QueuedAction:
    r = rng.random()
    kind = ResourceKind.CPU if r < 0.75 else ResourceKind.GPU if r < 0.9 else ResourceKind.API
    return QueuedAction(f"a{i}", traj, CostVector(kind, Elastic.range(1, 4)), float(i))


def _pools(rng: random.Random) -> list[PoolKey]:
    cpu = [("cpu", n, g) for n in NODES for g in (0, 1)]
    gpu = [("gpu", "g0", 0), ("gpu", "g1", 0)]
    picked = rng.sample(cpu + gpu, rng.randint(1, 6))
    return picked


def _ids(out: dict[PoolKey, list[QueuedAction]]) -> dict[PoolKey, list[str]]:
    return {p: [a.action_id for a in acts] for p, acts in out.items()}


@pytest.mark.parametrize("seed", range(40))
def test_indexed_distribution_equals_the_walk_over_a_list(seed: int) -> None:
    """Given the same random history (pins logged by the state, as `apply` makes them, or set
    directly), when distributing the rest each round, then a WaitingQueue and a plain list give
    the same pools, the same actions, in the same order."""
    rng = random.Random(seed)
    state = _state()
    q, plain = WaitingQueue(), []
    trajs = [f"t{i}" for i in range(30)]
    n = 0
    for _ in range(60):
        for _ in range(rng.randint(0, 8)):  # arrivals
            a = _action(n, rng.choice(trajs), rng)
            n += 1
            q.append(a)
            plain.append(a)
        r = rng.random()
        if r < 0.3:  # a trajectory gets pinned: as `apply` does (logged), or directly
            t, node = rng.choice(trajs), rng.choice(NODES)
            if t in state.trajectory_node:
                pass  # a pin is never overwritten in place
            elif rng.random() < 0.7:
                state.pin(t, node)
            else:
                state.trajectory_node[t] = node
        elif r < 0.4:  # a trajectory closes and may come back on another node later
            state.close_trajectory(rng.choice(trajs))
        elif r < 0.45:  # the scheduler restarted from its saved state
            state.restore({"trajectory_node": dict(state.trajectory_node)})
        pools = _pools(rng)
        skip = {a.action_id for a in rng.sample(plain, min(len(plain), rng.randint(0, 4)))}
        got = distribute_rest(q, state, pools, skip)
        want = distribute_rest(plain, state, pools, skip)
        assert _ids(got) == _ids(want)
        for a in rng.sample(plain, min(len(plain), rng.randint(0, 6))):  # starts
            q.pop(a.action_id)
            plain.remove(a)
        assert list(q) == plain


def test_a_trajectory_closed_and_pinned_again_elsewhere_moves_its_queued_action() -> None:
    """Given a queued action of a trajectory pinned to n0, when the trajectory is closed and
    pinned to n1, then its action counts for n1's pool, as over a plain list."""
    state = _state()
    state.trajectory_node["t"] = "n0"
    a = QueuedAction("a", "t", CostVector(ResourceKind.CPU, Elastic.range(1, 4)), 0.0)
    q = WaitingQueue([a])
    pools: list[PoolKey] = [("cpu", "n0", 0), ("cpu", "n1", 0)]
    assert _ids(distribute_rest(q, state, pools)) == {("cpu", "n0", 0): ["a"], ("cpu", "n1", 0): []}
    state.close_trajectory("t")
    state.trajectory_node["t"] = "n1"
    got = distribute_rest(q, state, pools)
    assert (
        _ids(got)
        == _ids(distribute_rest([a], state, pools))
        == {("cpu", "n0", 0): [], ("cpu", "n1", 0): ["a"]}
    )


def test_queue_is_a_fcfs_sequence() -> None:
    """Given appends and pops, then iteration, indexing, slicing, len and membership follow FCFS
    order; a duplicate id or an unknown pop is refused and changes nothing."""
    acts = [QueuedAction(f"a{i}", "t", CostVector(ResourceKind.CPU), float(i)) for i in range(5)]
    q = WaitingQueue(acts[:4])
    q.pop("a1")
    q.append(acts[4])
    assert [a.action_id for a in q] == ["a0", "a2", "a3", "a4"]
    assert q[0] is acts[0] and q[-1] is acts[4] and q[1:3] == [acts[2], acts[3]]
    assert len(q) == 4 and "a2" in q and acts[2] in q and "a1" not in q
    with pytest.raises(ValueError, match="a2"):
        q.append(acts[2])
    with pytest.raises(KeyError):
        q.pop("a1")
    assert [a.action_id for a in q] == ["a0", "a2", "a3", "a4"]
    assert q.position("a0") < q.position("a4")


def test_an_unpin_dropped_from_the_state_log_still_reroutes() -> None:
    """Given a queued action whose trajectory is unpinned, then so many other trajectories close
    that the state's unpin log is trimmed past it, when the rest is distributed, then the action
    counts as unpinned (spread over every CPU pool), as over a plain list."""
    state = _state()
    state.trajectory_node["t"] = "n0"
    a = QueuedAction("a", "t", CostVector(ResourceKind.CPU, Elastic.range(1, 4)), 0.0)
    q = WaitingQueue([a])
    pools: list[PoolKey] = [("cpu", "n1", 0)]
    assert _ids(distribute_rest(q, state, pools)) == {("cpu", "n1", 0): []}
    state.close_trajectory("t")
    for i in range(3000):
        state.trajectory_node[f"x{i}"] = "n2"
        state.close_trajectory(f"x{i}")
    assert state.unpin_base > 0
    assert (
        _ids(distribute_rest(q, state, pools))
        == _ids(distribute_rest([a], state, pools))
        == {("cpu", "n1", 0): ["a"]}
    )


def test_memoised_waiting_entries_follow_a_re_estimate_and_leave_with_the_action() -> None:
    """Given a queue's memo, then `waiting` gives the same entries as without it, recomputes
    one whose T1 changed while it waited, and forgets an action that left the queue."""
    from scheduler.duration import Amdahl
    from scheduler.policies.common import waiting

    acts = [
        QueuedAction(
            f"a{i}", "t", CostVector(ResourceKind.CPU, Elastic.range(2, 8)), 0.0, 10.0 + i, Amdahl(0.9)
        )
        for i in range(3)
    ]
    q = WaitingQueue(acts)
    assert waiting(q, q.memo) == waiting(q) == waiting(q, q.memo)
    acts[1].t1_s = 40.0  # the estimator learned more
    assert waiting(q, q.memo)[1] == (2, acts[1].duration_s(2), acts[1]) == waiting(q)[1]
    q.pop("a0")
    assert "a0" not in q.memo and set(q.memo) == {"a1", "a2"}


class _CountingDict(dict):  # type: ignore[type-arg]
    """A dict that counts the walks over its values."""

    walks = 0

    def values(self):  # type: ignore[no-untyped-def]
        type(self).walks += 1
        return super().values()


def test_new_pins_of_trajectories_with_nothing_queued_do_not_rewalk_the_unpinned() -> None:
    """Given 500 queued actions of unpinned new trajectories, when other trajectories are pinned
    as `apply` pins them (logged) and the index is brought up to date, then it does not walk
    the unpinned actions again; when a pin is set directly (unlogged), or a trajectory with an
    action queued is pinned, it does, and that action moves to its node."""
    state = _state()
    acts = [
        QueuedAction(f"a{i}", f"new{i}", CostVector(ResourceKind.CPU, Elastic.range(1, 4)), 0.0)
        for i in range(500)
    ]
    q = WaitingQueue(acts)
    r = q.routes(state)
    r.unpinned = _CountingDict(r.unpinned)
    _CountingDict.walks = 0
    for i in range(50):
        state.pin(f"started{i}", "n1")
        assert q.routes(state) is r
    assert _CountingDict.walks == 0
    state.trajectory_node["direct"] = "n2"
    q.routes(state)
    assert _CountingDict.walks == 1
    state.pin("new7", "n3")
    q.routes(state)
    assert _CountingDict.walks == 2
    assert "a7" in r.on_node["n3"] and "a7" not in r.unpinned
    assert len(r.unpinned) == 499


def test_a_pin_dropped_from_the_state_log_still_reroutes() -> None:
    """Given a queued action of an unpinned trajectory, when it is pinned (logged) and then so
    many others are pinned that the state's pin log is trimmed past it, then the action counts
    for its node, as over a plain list."""
    state = _state()
    a = QueuedAction("a", "t", CostVector(ResourceKind.CPU, Elastic.range(1, 4)), 0.0)
    q = WaitingQueue([a])
    pools: list[PoolKey] = [("cpu", "n2", 0), ("cpu", "n1", 0)]  # unpinned, it would go to n2
    q.routes(state)
    state.pin("t", "n1")
    for i in range(3000):
        state.pin(f"x{i}", "n2")
    assert state.pin_base > 0
    assert (
        _ids(distribute_rest(q, state, pools))
        == _ids(distribute_rest([a], state, pools))
        == {("cpu", "n2", 0): [], ("cpu", "n1", 0): ["a"]}
    )
