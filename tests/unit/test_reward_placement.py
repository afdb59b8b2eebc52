"""Evict-on-execution decisions (pure): placement, LRU victims, scaling."""

from __future__ import annotations

import pytest

from reward_servers.placement import (
    NodeReplicas,
    Replica,
    ReplicaState,
    ScalingPolicy,
    plan_placement,
    plan_scaling,
    plan_warmup,
    victims_for,
)


def ready(name: str, chunk: tuple[int, ...], used_s: float, mem: int = 1024, in_flight: int = 0) -> Replica:
    model, dop = name.split("__dop")[0], len(chunk)
    r = Replica(
        f"{model}__dop{dop}__g{chunk[0]}", model, dop, chunk, mem, ReplicaState.READY, in_flight, used_s
    )
    return r


def node(*replicas: Replica, gpus: int = 2, mem: int = 2048) -> NodeReplicas:
    return NodeReplicas(gpus, mem, {r.name: r for r in replicas})


def test_resident_chunk_is_preferred() -> None:
    """Given a service cached on GPU 1, when placed without a chunk, then it runs there with no load."""
    n = node(ready("a", (1,), 5.0))
    p = plan_placement(n, "a", 1, 1024)
    assert p is not None and p.chunk == (1,) and not p.load and p.victims == ()


def test_cold_service_goes_where_nothing_is_evicted() -> None:
    """Given GPU 0 full and GPU 1 empty, when a cold service is placed, then it loads on GPU 1."""
    n = node(ready("a", (0,), 1.0, mem=2048))
    p = plan_placement(n, "b", 1, 1024)
    assert p is not None and p.chunk == (1,) and p.load and p.victims == ()


def test_lru_victims_on_the_allocated_chunk() -> None:
    """Given GPU 0 holding two cached services, when a third needs room there, then the LRU one goes."""
    n = node(ready("old", (0,), 1.0), ready("new", (0,), 9.0))
    p = plan_placement(n, "c", 1, 1024, chunk=(0,))
    assert p is not None and p.victims == ("old__dop1__g0",)


def test_in_flight_replicas_are_never_evicted() -> None:
    """Given GPU 0 full of in-flight replicas, when a new service needs GPU 0, then there is no placement."""
    n = node(ready("a", (0,), 1.0, in_flight=1), ready("b", (0,), 2.0, in_flight=2))
    assert plan_placement(n, "c", 1, 1024, chunk=(0,)) is None
    assert victims_for(n, (0,), 4096) is None  # larger than a GPU


def test_dop2_evicts_across_both_gpus() -> None:
    """Given one replica on each GPU, when a DoP-2 service needs 2 GiB per GPU, then both go."""
    n = node(ready("a", (0,), 1.0), ready("b", (1,), 2.0))
    p = plan_placement(n, "big", 2, 2048)
    assert p is not None and p.chunk == (0, 1) and set(p.victims) == {"a__dop1__g0", "b__dop1__g1"}


def test_misaligned_chunk_is_refused() -> None:
    """Given a 4-GPU node, when asked for DoP 2 on GPUs (1, 2), then it is not a buddy chunk."""
    with pytest.raises(ValueError, match="aligned"):
        plan_placement(node(gpus=4), "a", 2, 1, chunk=(1, 2))


def test_hot_service_grows_to_another_chunk() -> None:
    """Given a service with a long queue on GPU 0, when scaling, then a replica is added on GPU 1."""
    n = node(ready("hot", (0,), 1.0, in_flight=1))
    plan = plan_scaling(n, {("hot", 1): 100}, {"hot": 1024}, now_s=2.0, policy=ScalingPolicy(32))
    assert [p.replica for p in plan.grow] == ["hot__dop1__g1"]


def test_growth_does_not_evict_a_hot_service() -> None:
    """Given two services both with demand and no free memory, when scaling, then nobody is evicted."""
    n = node(ready("a", (0,), 1.0, mem=2048), ready("b", (1,), 1.0, mem=2048))
    plan = plan_scaling(n, {("a", 1): 100, ("b", 1): 5}, {"a": 2048, "b": 2048}, now_s=2.0)
    assert plan.grow == ()


def test_idle_extra_replicas_shrink_but_one_stays_cached() -> None:
    """Given two idle replicas past the idle timeout, when scaling, then one is unloaded, the newer stays."""
    n = node(ready("a", (0,), 1.0), ready("a", (1,), 5.0))
    plan = plan_scaling(n, {}, {"a": 1024}, now_s=1000.0, policy=ScalingPolicy(idle_timeout_s=60))
    assert plan.shrink == ("a__dop1__g0",)


def test_lifecycle_rejects_illegal_moves() -> None:
    """Given an unloading replica, when moved back to ready, then the transition is refused."""
    n = node(ready("a", (0,), 1.0))
    n.transition("a__dop1__g0", ReplicaState.UNLOADING)
    with pytest.raises(ValueError, match="not allowed"):
        n.transition("a__dop1__g0", ReplicaState.READY)


def test_warm_up_places_every_service_once_then_fills_chunks_as_memory_allows() -> None:
    """Given an empty 2-GPU node with room for both services on each GPU, warm-up puts one
    replica of each service first (on different GPUs), then a second replica of each on the
    other GPU; with room for only one service per GPU, one replica each and nothing evicted."""
    plan = plan_warmup(node(mem=1024), [("sim", 1, 512), ("rm", 1, 256)])
    assert [p.replica for p in plan] == ["sim__dop1__g0", "rm__dop1__g1", "sim__dop1__g1", "rm__dop1__g0"]
    assert all(p.load and not p.victims for p in plan)
    tight = plan_warmup(node(mem=512), [("sim", 1, 512), ("rm", 1, 512)])
    assert [p.replica for p in tight] == ["sim__dop1__g0", "rm__dop1__g1"]


def test_warm_up_skips_what_is_resident_and_never_evicts() -> None:
    """Given GPU 0 full of an idle service and a service already on GPU 1, warm-up loads only
    where memory is free and never on a chunk that holds the service."""
    n = node(ready("old", (0,), 1.0, mem=2048), ready("rm", (1,), 1.0, mem=512))
    plan = plan_warmup(n, [("rm", 1, 512), ("sim", 1, 1024), ("big", 2, 512)])
    assert [p.replica for p in plan] == ["sim__dop1__g1"]
