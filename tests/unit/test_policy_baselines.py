"""Baselines and API quota control on small hand-worked cases."""

from __future__ import annotations

import pytest

from scheduler.duration import Amdahl
from scheduler.model import CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.policies import available, get_policy
from scheduler.resources import ApiPool, ClusterState, CpuNode, GpuNode


def cpu(aid: str, traj: str, hi: int = 1) -> QueuedAction:
    cost = CostVector(ResourceKind.CPU, Elastic.range(1, hi), memory_mb=100)
    return QueuedAction(aid, traj, cost, 0.0, t1_s=10.0, efficiency=Amdahl(0.9))


def gpu(aid: str, service: str) -> QueuedAction:
    cost = CostVector(ResourceKind.GPU, Elastic((1, 2, 4, 8)))
    return QueuedAction(aid, aid, cost, 0.0, t1_s=1.0, kind=f"reward:{service}", target=service)


def api(aid: str) -> QueuedAction:
    cost = CostVector(ResourceKind.API, api_quota=1)
    return QueuedAction(aid, aid, cost, 0.0, kind="api:search", target="search")


def test_every_policy_of_the_issue_is_registered() -> None:
    """Given the registry, when listed, then every policy the issue names can be built."""
    for name in [
        "fcfs-min",
        "tangram-dp",
        "tangram-fast",
        "static-pod",
        "fixed-dop-4",
        "dedicated-gpu",
        "cold-start",
        "per-trajectory-api",
    ]:
        assert get_policy(name).name == name
    assert "tangram-fast" in available()


def test_fixed_dop_runs_elastic_actions_at_k_and_rigid_ones_at_one() -> None:
    """Given 8 cores, when fixed-dop-4 decides an elastic and a rigid action, then 4 and 1."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 8, 10_000)})
    allocs = get_policy("fixed-dop-4").decide([cpu("a", "t1", 32), cpu("b", "t2")], state, 0.0)
    assert [a.units for a in allocs] == [4, 1]


def test_static_pod_admits_pods_by_request_and_runs_at_the_cap() -> None:
    """Given 1 core and 0.5-core requests, when 3 trajectories arrive, then 2 pods run (the
    elastic action with 4 threads, no core ids) and the third stays pending."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 1, 10_000)})
    queue = [cpu("a", "t1", 32), cpu("b", "t2"), cpu("c", "t3")]
    allocs = get_policy("static-pod").decide(queue, state, 0.0)
    assert [(a.action_id, a.units, a.unit_ids) for a in allocs] == [("a", 4, ()), ("b", 1, ())]


def test_static_pod_starts_actions_of_an_existing_pod_at_once() -> None:
    """Given a full node whose pod for t1 exists, when t1 submits, then it starts immediately."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 1, 10_000)})
    state.trajectory_node.update({"t1": "n", "t2": "n"})
    allocs = get_policy("static-pod").decide([cpu("x", "t3"), cpu("a", "t1")], state, 0.0)
    assert [a.action_id for a in allocs] == ["a"]


def two_nodes_with_pods(a: int, b: int) -> ClusterState:
    state = ClusterState(cpu={"a": CpuNode.uniform("a", 16, 10_000), "b": CpuNode.uniform("b", 16, 10_000)})
    state.trajectory_node.update({f"a{i}": "a" for i in range(a)} | {f"b{i}": "b" for i in range(b)})
    return state


@pytest.mark.parametrize(("packing", "node"), [("spread", "b"), ("binpack", "a")])
def test_static_pod_places_new_pods_by_the_configured_scoring(packing: str, node: str) -> None:
    """Given node a with 3 pods and b with 1, when a new trajectory arrives, then LeastAllocated
    ("spread") puts its pod on b and MostAllocated ("binpack") on a."""
    allocs = get_policy("static-pod", packing=packing).decide(
        [cpu("x", "new")], two_nodes_with_pods(3, 1), 0.0
    )
    assert [(a.action_id, a.pool) for a in allocs] == [("x", node)]


def test_static_pod_respects_max_pods_per_node() -> None:
    """Given max_pods 3 and nodes with 3 and 1 pods, when three trajectories arrive bin-packed,
    then the first two fill b up to 3 pods and the third stays pending (a and b are full)."""
    pol = get_policy("static-pod", packing="binpack", max_pods=3)
    allocs = pol.decide([cpu("x", "n1"), cpu("y", "n2"), cpu("z", "n3")], two_nodes_with_pods(3, 1), 0.0)
    assert [(a.action_id, a.pool) for a in allocs] == [("x", "b"), ("y", "b")]


@pytest.mark.parametrize(
    "params", [{"packing": "random"}, {"max_pods": 0}, {"request_cores": 0.0}, {"cap_cores": 0}]
)
def test_static_pod_rejects_bad_parameters(params: dict[str, object]) -> None:
    """Given a bad parameter, when the policy is built, then it says which one."""
    with pytest.raises(ValueError, match="static-pod"):
        get_policy("static-pod", **params)


def test_dedicated_gpu_gives_each_service_its_own_tp_group() -> None:
    """Given services a, b on one 8-GPU node with TP4, when 3 calls arrive, then a and b run on
    their own groups and the second call of a waits."""
    state = ClusterState(gpu={"g": GpuNode("g", 8, 80_000)})
    pol = get_policy("dedicated-gpu", services=["a", "b"], tp=4)
    allocs = pol.decide([gpu("1", "a"), gpu("2", "a"), gpu("3", "b")], state, 0.0)
    assert [(a.action_id, a.unit_ids) for a in allocs] == [("1", (0, 1, 2, 3)), ("3", (4, 5, 6, 7))]


def test_cold_start_runs_calls_at_their_minimum() -> None:
    """Given an empty GPU node, when cold-start decides two calls, then each gets one GPU."""
    state = ClusterState(gpu={"g": GpuNode("g", 8, 80_000)})
    allocs = get_policy("cold-start").decide([gpu("1", "a"), gpu("2", "b")], state, 0.0)
    assert [a.units for a in allocs] == [1, 1]


@pytest.mark.parametrize("name", ["fcfs-min", "tangram-dp", "tangram-fast"])
def test_quota_controlled_policies_never_exceed_the_token_bucket(name: str) -> None:
    """Given a 2-per-minute quota, when 3 calls wait, then 2 start and the third waits ~30 s."""
    pool = ApiPool("search", quota_per_window=2, window_s=60.0)
    state = ClusterState(api={"search": pool})
    queue = [api("1"), api("2"), api("3")]
    allocs = get_policy(name).decide(queue, state, 0.0)
    assert [a.action_id for a in allocs] == ["1", "2"]
    for a in allocs:
        state.apply(a, next(q for q in queue if q.action_id == a.action_id), 0.0)
    assert state.api["search"].next_fit_s(1, 0.0) == pytest.approx(30.0)


def test_concurrency_cap_is_respected() -> None:
    """Given a cap of 1 concurrent call, when 2 calls wait, then only one starts."""
    state = ClusterState(api={"search": ApiPool("search", max_concurrency=1)})
    allocs = get_policy("tangram-fast").decide([api("1"), api("2")], state, 0.0)
    assert len(allocs) == 1


def test_per_trajectory_api_ignores_the_quota() -> None:
    """Given an exhausted quota, when per-trajectory-api decides, then every call starts."""
    pool = ApiPool("search", quota_per_window=1, window_s=60.0, tokens=0.0)
    state = ClusterState(api={"search": pool})
    allocs = get_policy("per-trajectory-api").decide([api("1"), api("2")], state, 0.0)
    assert len(allocs) == 2


@pytest.mark.parametrize("name", ["fcfs-min", "tangram-dp", "tangram-fast", "fixed-dop-4"])
def test_a_new_trajectory_waiting_for_memory_does_not_block_pinned_ones(name: str) -> None:
    """Given a node whose memory is all held by two idle pinned trajectories (200 of 200 MiB),
    when a new trajectory's action is first in line and actions of the pinned ones follow, then
    the pinned ones start (only they can end a trajectory and free memory) and the new ones
    wait, in order: the second new trajectory does not overtake the first. The memory of a node
    that is offline does not count."""
    offline = CpuNode.uniform("gone", 8, 10_000)
    offline.online, offline.free = False, set()  # a lost node's memory is no way out
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 8, 200), "gone": offline})
    for traj in ("t1", "t2"):
        state.trajectory_node[traj] = "n"
        state.cpu["n"].trajectory_memory_mb[traj] = 100
    queue = [cpu("new", "t9"), cpu("p1", "t1"), cpu("new2", "t8"), cpu("p2", "t2")]
    started = {a.action_id for a in get_policy(name).decide(queue, state, 0.0)}
    assert started == {"p1", "p2"}


@pytest.mark.parametrize("name", ["fcfs-min", "tangram-dp", "tangram-fast"])
def test_an_action_waiting_for_cores_still_blocks_the_ones_behind_it(name: str) -> None:
    """Given 1 free core and memory to spare, when a 2-core rigid action is first in line, then
    the 1-core actions behind it wait (FCFS: cores free up as running actions end)."""
    big = QueuedAction(
        "big", "t1", CostVector(ResourceKind.CPU, Elastic.range(2, 2), memory_mb=100), 0.0, t1_s=10.0
    )
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 1, 10_000)})
    started = get_policy(name).decide([big, cpu("small", "t2")], state, 0.0)
    assert started == []


@pytest.mark.parametrize("name", ["fcfs-min", "tangram-dp", "tangram-fast"])
def test_a_rule_verifier_runs_anywhere_without_pinning_or_memory(name: str) -> None:
    """Given a trajectory pinned to a node with no free core and another node whose memory is
    all reserved, when the trajectory's rule verifier (a CPU action with no sandbox) is decided,
    then it runs on the other node, and neither pins the trajectory there nor reserves memory."""
    full = CpuNode.uniform("full", 1, 10_000)
    full.free = set()
    state = ClusterState(cpu={"full": full, "m": CpuNode.uniform("m", 2, 100)})
    state.trajectory_node["t1"] = "full"
    state.cpu["m"].trajectory_memory_mb["other"] = 100
    cost = CostVector(ResourceKind.CPU, Elastic.fixed(1), sandbox=False)
    rule = QueuedAction("rule", "t1", cost, 0.0, t1_s=0.01, kind="reward:math", target="math")
    allocs = get_policy(name).decide([rule], state, 0.0)
    assert [(a.action_id, a.pool) for a in allocs] == [("rule", "m")]
    state.apply(allocs[0], rule)
    assert state.trajectory_node["t1"] == "full" and state.cpu["m"].memory_free_mb == 0


def test_static_pod_spreads_by_requested_cpu_and_memory() -> None:
    """Given node a with 1 pod holding most of its memory and b with 2 small pods, when a new
    trajectory arrives, then LeastAllocated (cpu and memory, weight 1 each) picks b."""
    state = two_nodes_with_pods(1, 2)
    state.cpu["a"].trajectory_memory_mb["a0"] = 9_000
    allocs = get_policy("static-pod").decide([cpu("x", "new")], state, 0.0)
    assert [(a.action_id, a.pool) for a in allocs] == [("x", "b")]


def test_static_pod_defaults_to_the_kubelet_pod_limit_of_110() -> None:
    """Given a 256-core node already running 110 pods, when a new trajectory arrives with the
    defaults, then its pod stays pending; with max_pods None it is admitted."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 256, 10_000_000)})
    state.trajectory_node.update({f"p{i}": "n" for i in range(110)})
    assert get_policy("static-pod").decide([cpu("x", "new")], state, 0.0) == []
    assert len(get_policy("static-pod", max_pods=None).decide([cpu("x", "new")], state, 0.0)) == 1


@pytest.mark.parametrize(
    "params", [{"bind_qps": 0.0}, {"bind_burst": 0}, {"start_p50_s": 2.0, "start_p99_s": 1.0}]
)
def test_static_pod_rejects_bad_pod_start_parameters(params: dict[str, object]) -> None:
    """Given a bad binding rate or start-up distribution, when built, then it says which."""
    with pytest.raises(ValueError, match="static-pod"):
        get_policy("static-pod", **params)


def test_dedicated_gpu_sizes_replicas_by_load() -> None:
    """Given services a and b with loads 3:1 on 8 GPUs at TP1, when placed by load, then a gets
    6 groups and b 2 (D'Hondt), every group its own GPU."""
    state = ClusterState(gpu={"g": GpuNode("g", 8, 80_000)})
    pol = get_policy("dedicated-gpu", services=["a", "b"], tp=1, replicas="load", loads={"a": 3.0, "b": 1.0})
    plan = pol.placement(state)  # type: ignore[attr-defined]
    assert (len(plan["a"]), len(plan["b"])) == (6, 2)
    assert sorted(c for slots in plan.values() for _, c in slots) == [(g,) for g in range(8)]


def test_dedicated_gpu_serves_concurrent_calls_while_memory_lasts() -> None:
    """Given one 80 GB GPU, a 16 GB model and 16 GB per call, when 5 calls arrive with
    max_concurrent None, then 4 run together on the group ((80 - 16) // 16) and one waits."""
    state = ClusterState(gpu={"g": GpuNode("g", 1, 80_000)})
    pol = get_policy(
        "dedicated-gpu",
        services=["a"],
        tp=1,
        max_concurrent=None,
        model_mb={"a": 16_000},
        call_memory_mb=16_000,
    )
    allocs = pol.decide([gpu(str(i), "a") for i in range(5)], state, 0.0)
    assert [(a.action_id, a.unit_ids) for a in allocs] == [(str(i), (0,)) for i in range(4)]


def test_dedicated_gpu_routes_a_call_to_the_least_loaded_replica() -> None:
    """Given service a on GPUs 0 and 1 with GPU 0 already serving a call, when a call arrives,
    then it goes to GPU 1."""
    state = ClusterState(gpu={"g": GpuNode("g", 2, 80_000)})
    pol = get_policy("dedicated-gpu", services=["a"], tp=1, replicas="load", max_concurrent=4)
    state.apply(pol.decide([gpu("0", "a")], state, 0.0)[0], gpu("0", "a"))
    assert [a.unit_ids for a in pol.decide([gpu("1", "a")], state, 0.0)] == [(1,)]


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("dedicated-gpu", {"tp": 3}),
        ("dedicated-gpu", {"replicas": "many"}),
        ("dedicated-gpu", {"max_concurrent": 0}),
        ("cold-start", {"keep_alive_s": -1.0}),
        ("cold-start", {"load_from": "tape"}),
    ],
)
def test_gpu_baselines_reject_bad_parameters(name: str, params: dict[str, object]) -> None:
    """Given a bad parameter, when the GPU baseline is built, then it says which one."""
    with pytest.raises(ValueError, match=name):
        get_policy(name, **params)
