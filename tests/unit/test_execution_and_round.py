"""Execution models, the one GPU eviction rule, and what the round plans beyond `decide`."""

from __future__ import annotations

import pytest

from reward_servers.placement import NodeReplicas, Replica, ReplicaState, victims_for
from scheduler.execution import ExecutionModel, GpuResidency, execution_of
from scheduler.gpu_cache import GpuCache, Instance, lru_victims
from scheduler.model import CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.policies import available, get_policy, live_policies
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState, CpuNode, GpuNode
from scheduler.round import Round
from scheduler.sim import ClusterSpec, build
from scheduler.sim.cluster import ExecParams
from scheduler.sim.engine import Simulator
from tangram_celery.common.config import parse_config
from tangram_celery.common.errors import ConfigError


def test_every_policy_declares_a_frozen_execution_model() -> None:
    """Each registered policy declares an ExecutionModel (immutable); Tangram's own policies
    and fixed DoP run live, the baselines with another execution model do not."""
    for name in available():
        model = get_policy(name).execution
        assert isinstance(model, ExecutionModel)
        with pytest.raises(AttributeError):
            model.cpu_sharing = True  # type: ignore[misc]
    assert live_policies() == ["fcfs-min", "fixed-dop", "tangram-dp", "tangram-fast"]
    assert get_policy("static-pod").execution.cpu_sharing
    assert get_policy("cold-start", keep_alive_s=5.0).execution.gpu_residency is GpuResidency.KEEPALIVE
    assert not get_policy("per-trajectory-api", max_retries=1).execution.api_control
    assert get_policy("per-trajectory-api", max_retries=1).execution.retries.max_retries == 1


def test_a_policy_whose_execution_is_not_a_model_is_refused() -> None:
    """execution_of defaults to Tangram's model and refuses anything but an ExecutionModel."""

    class Odd:
        name = "odd"
        execution = {"cpu_sharing": True}

    assert execution_of(object()) == ExecutionModel()
    with pytest.raises(TypeError, match="odd"):
        execution_of(Odd())


@pytest.mark.parametrize("policy", ["static-pod", "dedicated-gpu", "cold-start", "per-trajectory-api"])
def test_the_live_config_refuses_a_simulator_only_policy(policy: str) -> None:
    """A deployment config naming a baseline the live service cannot execute fails to load,
    saying why and which policies it can run."""
    with pytest.raises(ConfigError, match="runs in the simulator only") as e:
        parse_config({"scheduler": {"policy": policy}})
    assert "tangram-fast" in str(e.value) and "fixed-dop-K" in str(e.value)


def test_lru_victims_takes_only_instances_on_a_short_gpu() -> None:
    """Given a 2-GPU chunk where only GPU 0 lacks memory, the older instance on GPU 1 is kept
    and the younger one on GPU 0 goes; None when even all idle ones would not make room."""
    idle = [Instance("old-on-1", (1,), 500, 1.0), Instance("new-on-0", (0,), 500, 5.0)]
    assert lru_victims(idle, (0, 1), 600, {0: 200, 1: 900}, 1000) == ["new-on-0"]
    assert lru_victims(idle, (0, 1), 900, {0: 200, 1: 300}, 1000) is None
    assert lru_victims(idle, (0,), 2000, {0: 1000}, 1000) is None


def test_the_worker_and_the_scheduler_evict_alike() -> None:
    """The replica table of a GPU worker and the scheduler's GpuCache, holding the same
    instances with the same last uses, pick the same victims for a new service."""
    node = NodeReplicas(2, 1000)
    cache = GpuCache(1000, lambda s, u: 400)
    for name, chunk, used in (("a", (0,), 3.0), ("b", (1,), 1.0), ("c", (0,), 2.0)):
        node.replicas[name] = Replica(name, name, 1, chunk, 400, ReplicaState.READY, 0, used)
        cache.resident.setdefault(chunk, []).append(name)
        cache.touch(chunk, name, used)
    assert victims_for(node, (0, 1), 400) == ("c",)
    assert cache.victims((0, 1), "d") == [((0,), "c")]


def _reward(aid: str, target: str = "rm") -> QueuedAction:
    return QueuedAction(
        aid, aid, CostVector(ResourceKind.GPU, Elastic((1,))), 0.0, kind=f"reward:{target}", target=target
    )


def test_the_round_plans_gpu_loads_in_order_and_riders_on_the_leaders_chunk() -> None:
    """Given two services that each need a whole GPU and one free GPU each, the round plans
    each GPU allocation's load (a restore evicting what was resident) and, with a batch of 3,
    seats two waiting calls of the first service on its chunk."""
    state = ClusterState(gpu={"g": GpuNode("g", 2, 1000)})
    state.attach_gpu_caches(lambda s, u: 800)
    state.learn_residency("g", {(0,): ["old"], (1,): ["rm"]}, 0.0)
    q = WaitingQueue([_reward("r1"), _reward("s1", "sim"), _reward("r2"), _reward("r3"), _reward("r4")])
    plan = Round(get_policy("fcfs-min"), max_batch=lambda s: 3 if s == "rm" else 1).plan(q, state, 1.0)
    assert [(a.action_id, a.unit_ids) for a in plan.allocs] == [("r1", (1,)), ("s1", (0,))]
    assert [(a.action_id, a.unit_ids) for a in plan.riders] == [("r2", (1,)), ("r3", (1,))]
    assert plan.gpu_loads["r1"].hit and plan.gpu_loads["s1"].victims == (((0,), "old"),)
    assert state.gpu["g"].resident == {(0,): ["old"], (1,): ["rm"]}  # planning changes nothing


def test_the_simulator_runs_riders_as_one_batch_when_asked() -> None:
    """With ExecParams.max_batch above 1 the simulator seats waiting calls on a GPU allocation
    (as the live service does) and they finish together; the default keeps every call alone."""
    sc = build("mopd", {"batch": 64}, cluster=ClusterSpec(cpu_nodes=0, gpus_total=2))
    alone = Simulator(sc, get_policy("fcfs-min")).run()
    batched_sc = build("mopd", {"batch": 64}, cluster=ClusterSpec(cpu_nodes=0, gpus_total=2))
    object.__setattr__(batched_sc, "exec_params", ExecParams(max_batch=8))
    batched = Simulator(batched_sc, get_policy("fcfs-min")).run()
    assert alone.unfinished == 0 and batched.unfinished == 0
    assert batched.summary()["avg_act_s"] < alone.summary()["avg_act_s"]


def test_offline_pools_keep_released_units_out_of_placement() -> None:
    """A node taken offline has no free cores; a core released there stays out until the node
    is back; its pinned trajectories are reported for release."""
    state = ClusterState(cpu={"n": CpuNode.uniform("n", 2, 1000)})
    qa = QueuedAction("a", "t", CostVector(ResourceKind.CPU, memory_mb=10), 0.0)
    alloc = state.place(qa, 1)
    assert alloc is not None
    state.apply(alloc, qa)
    went, back, lost = state.set_offline({"cpu:n"})
    assert (went, back, lost) == ({"cpu:n"}, set(), ["t"]) and not state.cpu["n"].free
    state.release("a")
    assert not state.cpu["n"].free
    _, back, _ = state.set_offline(set())
    assert back == {"cpu:n"} and state.cpu["n"].free == {0, 1}
