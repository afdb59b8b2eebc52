"""CPU memory is a cache: idle trajectories are evicted, least recently used first, to place an
action that lacks memory, and a later action asking for more memory reserves the increase."""

from __future__ import annotations

import random

import pytest

from scheduler.duration import Amdahl
from scheduler.model import Allocation, CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.policies import get_policy
from scheduler.policies.fixed_dop import fixed_units
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState, CpuNode
from scheduler.sim import ClusterSpec, build, simulate

POLICIES = ["fcfs-min", "tangram-dp", "tangram-fast", "fixed-dop-4"]


def code(aid: str, traj: str, memory_mb: int = 100, units: tuple[int, int] = (1, 1)) -> QueuedAction:
    cost = CostVector(ResourceKind.CPU, Elastic.range(*units), memory_mb=memory_mb)
    return QueuedAction(aid, traj, cost, 0.0, t1_s=5.0, efficiency=Amdahl(0.9))


def node_with_idle(memory_mb: int, idle: dict[str, int], cores: int = 8) -> ClusterState:
    """One node whose memory is held by `idle` trajectories (used in the given order)."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", cores, memory_mb)})
    for i, (traj, mb) in enumerate(idle.items()):
        q = code(f"old-{traj}", traj, mb)
        alloc = state.place(q, 1)
        assert alloc is not None
        state.apply(alloc, q, float(i))
        state.release(alloc.action_id, float(i) + 0.5)
    return state


@pytest.mark.parametrize("name", POLICIES)
def test_a_new_trajectory_evicts_the_least_recently_used_idle_ones(name: str) -> None:
    """Given a node whose 400 MiB are held by four idle trajectories (100 MiB each), when a new
    trajectory needs 150 MiB, then it starts at once, evicting the two used least recently, and
    applying the decision frees their pins and reservations."""
    state = node_with_idle(400, {"t1": 100, "t2": 100, "t3": 100, "t4": 100})
    new = code("a", "new", 150)
    allocs = get_policy(name).decide([new], state, 10.0)
    assert [(a.action_id, a.evict) for a in allocs] == [("a", ("t1", "t2"))]
    state.apply(allocs[0], new, 10.0)
    assert set(state.trajectory_node) == {"t3", "t4", "new"}
    assert state.cpu["n"].memory_free_mb == 400 - 200 - 150


@pytest.mark.parametrize("name", POLICIES)
def test_only_idle_trajectories_are_evicted(name: str) -> None:
    """Given three trajectories holding all memory, the oldest running an action and the next
    with an action queued, when a new trajectory needs memory, then only the third (idle,
    though used most recently) is evicted."""
    state = node_with_idle(300, {"t1": 100, "t2": 100, "t3": 100})
    running = code("run", "t1")
    state.apply(Allocation("run", ResourceKind.CPU, "n", 1, (7,)), running, 5.0)
    queue = [code("a", "new", 100), code("b", "t2")]
    allocs = {a.action_id: a for a in get_policy(name).decide(queue, state, 10.0)}
    assert allocs["a"].evict == ("t3",)
    assert "b" in allocs


@pytest.mark.parametrize("name", POLICIES)
def test_memory_freed_by_an_eviction_beyond_the_need_waits_for_the_next_round(name: str) -> None:
    """Given 50 MiB free and idle trajectories of 100 MiB, when two new trajectories need 100
    MiB each in one round, then each evicts its own victim (the first one's leftover 50 MiB
    is not handed on within the round) and both start."""
    state = node_with_idle(350, {"t1": 100, "t2": 100, "t3": 100})
    queue = [code("a", "x", 100), code("b", "y", 100)]
    allocs = get_policy(name).decide(queue, state, 10.0)
    assert [(a.action_id, a.evict) for a in allocs] == [("a", ("t1",)), ("b", ("t2",))]
    for alloc, q in zip(allocs, queue, strict=True):
        state.apply(alloc, q, 10.0)
    assert state.cpu["n"].memory_free_mb == 50


@pytest.mark.parametrize("name", POLICIES)
def test_nothing_is_evicted_for_an_action_that_lacks_cores(name: str) -> None:
    """Given a node with no free core whose memory is held by an idle trajectory, when a new
    trajectory waits, then nothing starts and nothing is evicted."""
    state = node_with_idle(100, {"t1": 100}, cores=1)
    state.apply(Allocation("busy", ResourceKind.CPU, "n", 1, (0,)), code("busy", "other", 0), 5.0)
    assert get_policy(name).decide([code("a", "new", 100)], state, 10.0) == []


def test_evicting_a_busy_trajectory_is_refused_and_changes_nothing() -> None:
    """Given a trajectory with an action running, when an allocation evicting it is applied,
    then apply raises and the state keeps every pin and reservation."""
    state = node_with_idle(200, {"t1": 100, "t2": 100})
    state.apply(Allocation("run", ResourceKind.CPU, "n", 1, (7,)), code("run", "t2"), 5.0)
    before = state.to_dict()
    bad = Allocation("a", ResourceKind.CPU, "n", 1, (0,), evict=("t1", "t2"))
    with pytest.raises(ValueError, match="t2"):
        state.apply(bad, code("a", "new"), 6.0)
    assert state.to_dict() == before


def test_allocations_with_evictions_survive_persistence() -> None:
    """Given an evicting allocation, when it goes through to_dict/from_dict, then it is equal."""
    alloc = Allocation("a", ResourceKind.CPU, "n", 2, (0, 1), evict=("t1", "t2"))
    assert Allocation.from_dict(alloc.to_dict()) == alloc
    assert "evict" not in Allocation("b", ResourceKind.CPU, "n", 1, (0,)).to_dict()


@pytest.mark.parametrize("name", POLICIES)
def test_a_larger_memory_ask_reserves_the_increase(name: str) -> None:
    """Given a trajectory that reserved 96 MiB on a node with room, when its next action asks
    for 320 MiB, then it starts and its reservation becomes 320 MiB."""
    state = node_with_idle(1000, {"t1": 96})
    q = code("a", "t1", 320)
    allocs = get_policy(name).decide([q], state, 10.0)
    assert [a.action_id for a in allocs] == ["a"]
    state.apply(allocs[0], q, 10.0)
    assert state.cpu["n"].trajectory_memory_mb["t1"] == 320
    assert state.cpu["n"].memory_free_mb == 1000 - 320


@pytest.mark.parametrize("name", POLICIES)
def test_a_larger_memory_ask_waits_without_blocking_others(name: str) -> None:
    """Given a full node (t1 holds 96 MiB, t2 the rest, both with actions queued), when t1 asks
    for 320 MiB, then it waits (its later action too), and t2's action behind it starts."""
    state = node_with_idle(400, {"t1": 96, "t2": 304})
    queue = [code("a", "t1", 320), code("a2", "t1", 96), code("b", "t2", 304)]
    started = [a.action_id for a in get_policy(name).decide(queue, state, 10.0)]
    assert started == ["b"]


@pytest.mark.parametrize("name", POLICIES)
def test_a_larger_memory_ask_evicts_idle_trajectories(name: str) -> None:
    """Given a full node where t2 is idle, when t1 asks for 200 MiB more than it holds, then
    t2 is evicted for it."""
    state = node_with_idle(400, {"t1": 100, "t2": 300})
    q = code("a", "t1", 300)
    allocs = get_policy(name).decide([q], state, 10.0)
    assert [(a.action_id, a.evict) for a in allocs] == [("a", ("t2",))]
    state.apply(allocs[0], q, 10.0)
    assert state.cpu["n"].trajectory_memory_mb == {"t1": 300}


def random_case(rng: random.Random) -> tuple[ClusterState, list[QueuedAction]]:
    """Nodes with some cores busy and memory held by pinned trajectories, some of them idle,
    and a queue whose head is a 1-core action."""
    nodes = {}
    for n in range(rng.randint(1, 3)):
        nodes[f"n{n}"] = CpuNode.uniform(f"n{n}", rng.choice([2, 4, 8]), rng.choice([300, 600, 1000]))
    state = ClusterState(cpu=nodes)
    trajs = []
    for i in range(rng.randint(0, 12)):
        mb = rng.choice([50, 100, 200])
        q = code(f"old{i}", f"p{i}", mb)
        alloc = state.place(q, 1)
        if alloc is None:
            continue
        state.apply(alloc, q, float(i))
        trajs.append(f"p{i}")
        if rng.random() < 0.6:
            state.release(alloc.action_id, float(i) + 0.5)
    queue: list[QueuedAction] = []
    for j in range(rng.randint(1, 10)):
        if trajs and rng.random() < 0.4:
            queue.append(code(f"q{j}", rng.choice(trajs), rng.choice([50, 100, 200])))
        else:
            queue.append(code(f"q{j}", f"new{j}", rng.choice([50, 100, 200]), (1, rng.choice([1, 2, 4]))))
    return state, queue


def could_start(state: ClusterState, action: QueuedAction, busy: set[str], units: int) -> bool:
    """Whether `action` has `units` cores on a node where free plus idle memory is enough."""
    pinned = state.trajectory_node.get(action.trajectory_id)
    need = state.memory_extra_mb(action)
    for node in state.cpu.values():
        if pinned is not None and node.name != pinned:
            continue
        idle = state.idle_trajectories(node.name, busy)
        spare = node.memory_free_mb + sum(node.trajectory_memory_mb[t] for t in idle)
        if node.max_block() >= units and spare >= need:
            return True
    return False


@pytest.mark.parametrize("name", POLICIES)
def test_no_round_stalls_with_free_cores_and_evictable_memory(name: str) -> None:
    """Given 400 random states (busy cores, memory held by pinned trajectories, some idle), when
    the head of the line has the cores it needs on a node where free plus idle memory is
    enough, then the round starts it, every decision applies in order, nothing running or
    queued is evicted, and no node's memory is over-committed."""
    rng = random.Random(12)
    checked = 0
    for _ in range(400):
        state, queue = random_case(rng)
        busy = {a.trajectory_id for a in queue}
        head = queue[0]
        units = fixed_units(head, 4) if name == "fixed-dop-4" else head.cost.units.min
        if not could_start(state, head, busy, units):
            continue
        checked += 1
        allocs = get_policy(name).decide(WaitingQueue(queue), state, 100.0)
        assert queue[0].action_id in {a.action_id for a in allocs}
        by_id = {a.action_id: a for a in queue}
        for alloc in allocs:
            assert not set(alloc.evict) & busy
            state.apply(alloc, by_id[alloc.action_id], 100.0)
        assert all(n.memory_free_mb >= 0 for n in state.cpu.values())
    assert checked > 100


def test_the_simulator_models_evictions_and_the_fresh_sandbox_they_cost() -> None:
    """Given a coding workload with sandbox memory for 8 trajectories per node, when simulated
    under tangram-fast, then every action completes, idle trajectories are evicted, and each
    action that found its sandbox evicted pays a fresh sandbox start."""
    sc = build(
        "coding",
        {"batch": 48},
        cluster=ClusterSpec(cpu_nodes=2, cores_per_node=16, memory_mb_per_node=8 * 4096),
    )
    res = simulate(sc, "tangram-fast")
    summary = res.summary()
    assert summary["unfinished"] == 0
    assert summary["evictions"] > 0 and summary["sandbox_resets"] > 0
    starts = sum(1 for r in res.records if r.key == "cpu" and r.setup_s >= 0.3)
    assert starts == 48 + summary["sandbox_resets"]


class CountingQueue(WaitingQueue):
    """A `WaitingQueue` that counts the actions a pass takes from its FCFS iterator, and the
    passes that went on over its pinned and unsandboxed actions alone."""

    def __init__(self, actions: list[QueuedAction]) -> None:
        super().__init__(actions)
        self.walked = 0
        self.sparse = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        for a in super().__iter__():
            self.walked += 1
            yield a

    def behind_full_memory(self, state, after):  # type: ignore[no-untyped-def]
        self.sparse += 1
        return super().behind_full_memory(state, after)


def busy_node(memory_mb: int, busy: int, cores: int = 8) -> ClusterState:
    """One node whose memory is all held by `busy` trajectories with an action running."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", cores, memory_mb)})
    for i in range(busy):
        q = code(f"run{i}", f"b{i}", memory_mb // busy)
        alloc = state.place(q, 1)
        assert alloc is not None
        state.apply(alloc, q, float(i))
    return state


def test_a_burst_waiting_for_memory_is_not_walked_each_round() -> None:
    """Given a node whose memory is held by 2 running trajectories and 6 free cores, and 500
    new trajectories queued ahead of an action of a pinned trajectory, an action without a
    sandbox and an API call, when tangram-fast decides, then the three behind the burst start
    as over a plain list, and the pass looks at the first new trajectory only, not at the
    other 499."""
    state = busy_node(200, 2)
    burst = [code(f"new{i}", f"new{i}", 100) for i in range(500)]
    pinned = code("pinned", "b0", 100)
    free = QueuedAction(
        "verifier", "v", CostVector(ResourceKind.CPU, Elastic.fixed(1), sandbox=False), 0.0, t1_s=1.0
    )
    api = QueuedAction(
        "api", "x", CostVector(ResourceKind.API, Elastic.fixed(1), api_quota=1), 0.0, target="llm"
    )
    actions = [*burst, pinned, free, api]
    queue = CountingQueue(actions)
    policy = get_policy("tangram-fast")
    got = [(a.action_id, a.units) for a in policy.decide(queue, state, 10.0)]
    want = [(a.action_id, a.units) for a in policy.decide(list(actions), state, 10.0)]
    assert got == want
    assert {"pinned", "verifier"} <= {aid for aid, _ in got}
    assert queue.sparse == 1 and queue.walked == 1


def mixed_case(rng: random.Random) -> tuple[ClusterState, list[QueuedAction]]:
    """`random_case` with tight memory, longer queues, actions without a sandbox, new
    trajectories with several actions queued, and API calls."""
    state, queue = random_case(rng)
    for j in range(rng.randint(0, 30)):
        r = rng.random()
        if r < 0.1:
            cost = CostVector(ResourceKind.CPU, Elastic.fixed(1), sandbox=False)
            queue.append(QueuedAction(f"v{j}", f"v{j}", cost, 0.0, t1_s=1.0))
        elif r < 0.15:
            cost = CostVector(ResourceKind.API, Elastic.fixed(1), api_quota=1)
            queue.append(QueuedAction(f"api{j}", f"c{j}", cost, 0.0, target="llm"))
        elif r < 0.3 and queue:
            queue.append(code(f"m{j}", rng.choice(queue).trajectory_id, rng.choice([50, 100, 200])))
        else:
            queue.append(code(f"n{j}", f"burst{j}", rng.choice([100, 200, 400])))
    return state, queue


def test_the_pass_over_a_waiting_queue_decides_as_the_walk_over_a_list() -> None:
    """Given 600 random states and queues, many of them with memory too full for the new
    trajectories queued, when tangram-fast decides over a `WaitingQueue` and over a plain list
    of the same actions, then both decisions are the same, and the pass skipped the new
    trajectories in many of them."""
    rng = random.Random(7)
    policy = get_policy("tangram-fast")
    sparse = 0
    for _ in range(600):
        state, actions = mixed_case(rng)
        queue = CountingQueue(actions)
        got = policy.decide(queue, state, 100.0)
        want = policy.decide(list(actions), state, 100.0)
        assert [(a.action_id, a.pool, a.units, a.unit_ids, a.evict) for a in got] == [
            (a.action_id, a.pool, a.units, a.unit_ids, a.evict) for a in want
        ]
        sparse += queue.sparse > 0
    assert sparse > 60
