"""Images as a resource (issue 36): node image stores, image-aware placement, fetches ahead,
ImageLocality for the pod baseline, and the simulated SWE-images workload."""

from __future__ import annotations

import io

import pytest

from scheduler.images import ImageStore
from scheduler.model import Allocation, CostVector, QueuedAction, ResourceKind
from scheduler.policies import get_policy
from scheduler.policies.static_pod import image_locality_score
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState, CpuNode
from scheduler.round import Round
from scheduler.service.cluster import learn_images
from scheduler.sim import build, simulate
from scheduler.sim.trace import read_workload, write_workload
from tangram_celery.common.wire import ActionMeta

pytestmark = pytest.mark.unit


def cluster(n: int = 3, budget_mb: int | None = 10_000) -> ClusterState:
    state = ClusterState()
    for i in range(n):
        node = CpuNode.uniform(f"n{i}", 8, 64_000)
        node.store = ImageStore(budget_mb, mb_per_s=100.0)
        state.cpu[node.name] = node
    return state


def code(aid: str, tid: str, image: str = "", image_mb: int = 0, now_s: float = 0.0) -> QueuedAction:
    qa = QueuedAction(aid, tid, CostVector(ResourceKind.CPU, memory_mb=1_000), now_s)
    qa.image, qa.image_mb = image, image_mb
    return qa


def test_store_evicts_unused_images_least_recently_used_first_and_fetches_one_at_a_time() -> None:
    """Given a full store with one image in use, when a new image needs room, then the least
    recently used unused image goes, and a second fetch waits behind the first on the link."""
    s = ImageStore(budget_mb=3_000, mb_per_s=100.0, held={"a": 1_000, "b": 1_000, "c": 1_000})
    s.users["t1"] = "a"
    assert s.victims(1_500) == ["b", "c"]
    assert s.fetch("d", 1_000, 0.0) == pytest.approx(10.0)
    assert "b" not in s.held and "a" in s.held
    assert s.wait_s("e", 500, 0.0) == pytest.approx(15.0)  # behind d's 10 s, evicting c
    assert s.wait_s("f", 2_500, 0.0) is None  # only by evicting "a", which is in use
    s.arrived("d")
    assert s.wait_s("d", 1_000, 11.0) == 0.0


def test_tangram_fast_places_a_new_trajectory_where_its_image_is() -> None:
    """Given three idle nodes and the image held only on the one with the least free memory,
    when a new trajectory in that image comes, then tangram-fast places it there."""
    state = cluster()
    state.cpu["n2"].store.held["img"] = 2_000  # type: ignore[union-attr]
    state.cpu["n2"].trajectory_memory_mb["other"] = 5_000
    q = WaitingQueue()
    q.append(code("a1", "t1", "img", 2_000))
    allocs = get_policy("tangram-fast").decide(q, state, 0.0)
    assert [a.pool for a in allocs] == ["n2"]


def test_an_evicted_image_trajectory_keeps_its_layer_and_resumes_on_its_node() -> None:
    """Given an image trajectory evicted from n1, when its next action comes, then its layer is
    on n1 and tangram-fast places it there, though n0 holds the image too."""
    state = cluster()
    for n in ("n0", "n1"):
        state.cpu[n].store.held["img"] = 2_000  # type: ignore[union-attr]
    first = code("a1", "t1", "img", 2_000)
    state.apply(Allocation("a1", ResourceKind.CPU, "n1", 1, (0,)), first)
    state.release("a1", 1.0)
    state.apply(Allocation("b1", ResourceKind.CPU, "n1", 1, (1,), evict=("t1",)), code("b1", "t2"))
    assert state.cpu["n1"].store.layers == {"t1": "img"}  # type: ignore[union-attr]
    q = WaitingQueue()
    q.append(code("a2", "t1", "img", 2_000, 2.0))
    assert [a.pool for a in get_policy("tangram-fast").decide(q, state, 2.0)] == ["n1"]


def test_the_round_fetches_queued_images_ahead_and_non_image_rounds_fetch_nothing() -> None:
    """Given no free core anywhere, when trajectories in two images wait, then tangram-fast's
    round orders both images fetched (onto different links); a round without images none."""
    state = cluster(2)
    for n in state.cpu.values():
        n.free.clear()
    q = WaitingQueue()
    q.append(code("a1", "t1", "img1", 1_000))
    q.append(code("a2", "t2", "img2", 1_000))
    plan = Round(get_policy("tangram-fast")).plan(q, state, 0.0)
    assert sorted((f.node, f.image) for f in plan.fetches) == [("n0", "img1"), ("n1", "img2")]
    q2 = WaitingQueue()
    q2.append(code("b1", "u1"))
    assert Round(get_policy("tangram-fast")).plan(q2, state, 0.0).fetches == []


def test_image_locality_scores_as_kube_scheduler_does() -> None:
    """Given a 2,000 MB image on 1 of 4 nodes, then that node scores 100 * (500 - 23) / 977 with
    sizes in MiB (kube's spread scaling and clamps), the others 0; on all 4 nodes, 100."""
    state = cluster(4, None)
    state.cpu["n0"].store.held["img"] = 2_000  # type: ignore[union-attr]
    assert image_locality_score(state, "n0", "img") == 100 * (500 - 23) // 977
    assert image_locality_score(state, "n1", "img") == 0
    for n in state.cpu.values():
        n.store.held["img"] = 2_000  # type: ignore[union-attr]
    assert image_locality_score(state, "n3", "img") == 100


def test_swe_images_tangram_fast_fetches_less_and_beats_the_pod_baselines() -> None:
    """Given a small swe-images run, then every policy finishes, and tangram-fast fetches fewer
    images and has a lower average ACT than static-pod and all-at-once."""
    sc = build("swe-images", {"tasks": 6, "group": 4, "cpu_nodes": 3, "cores_per_node": 16})
    res = {p: simulate(sc, p) for p in ("tangram-fast", "static-pod", "all-at-once")}
    assert all(r.unfinished == 0 for r in res.values())
    fast = res["tangram-fast"]
    for base in ("static-pod", "all-at-once"):
        assert fast.image_fetches <= res[base].image_fetches
        assert fast.avg_act_s() < res[base].avg_act_s()


def test_the_service_learns_each_nodes_images_from_its_workers_report() -> None:
    """Given reports for n0 (held, fetchable, a kept layer) and an unreadable one for n1, when
    the service learns them, then n0's store holds them and n1 and n2 keep no store."""
    state = ClusterState(cpu={f"n{i}": CpuNode.uniform(f"n{i}", 4, 8_000) for i in range(3)})
    learn_images(
        state,
        {
            "n0": {"held": [["swe/a:1", 2_000_000_000]], "fetchable": ["swe/b:1"], "layers": ["t1"]},
            "n1": {"held": "garbage"},
        },
    )
    store = state.cpu["n0"].store
    assert store is not None and store.held == {"swe/a:1": 2_000}
    assert store.fetchable == {"swe/a:1", "swe/b:1"} and "t1" in store.layers
    assert state.cpu["n1"].store is None and state.cpu["n2"].store is None


def test_action_metadata_carries_the_image_to_the_queued_action() -> None:
    """Given a code action in an image, then its metadata and its queued action name it; a
    reward action's metadata cannot."""
    meta = ActionMeta(id="a1", type="code", submitted_s=0.0, cpus=(1, 1), memory_mb=64, image="swe/a:1")
    assert ActionMeta.model_validate_json(meta.dumps()).image == "swe/a:1"
    with pytest.raises(ValueError):
        ActionMeta(id="a2", type="reward", submitted_s=0.0, model="rm", image="swe/a:1")


def test_a_recorded_swe_images_trace_replays_with_its_images_and_stores() -> None:
    """Given a small swe-images scenario written as a JSONL trace, when it is read back, then
    its actions name their images and its cluster keeps the image stores' parameters."""
    sc = build("swe-images", {"tasks": 2, "group": 2, "cpu_nodes": 2, "cores_per_node": 8})
    out = io.StringIO()
    write_workload(sc, out)
    back = read_workload(out.getvalue().splitlines())
    assert back.trajectories[0].steps[0].action.image == sc.trajectories[0].steps[0].action.image
    assert back.cluster.image_mb_per_s == sc.cluster.image_mb_per_s > 0
    assert back.cluster.image_store_mb == sc.cluster.image_store_mb
