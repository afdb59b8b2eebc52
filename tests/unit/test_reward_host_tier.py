"""The host-memory tier (issue 38): evicted replicas stay in host memory and come back by a
restore; a cold load happens only when the host budget cannot hold the service."""

from __future__ import annotations

import pytest

from reward_servers.errors import ModelLoadFailed
from reward_servers.placement import NodeReplicas, Replica, ReplicaState, plan_placement, plan_warmup
from reward_servers.replicas import ReplicaManager
from reward_servers.testing import FakeController
from scheduler.gpu_cache import Tier
from tangram_celery.common.config import GpuNodeConfig


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def manager(ctl: FakeController, host_memory_mb: int = 8192, gpus: int = 1) -> ReplicaManager:
    """One GPU of 1024 MiB: one of the 1024 MiB services at a time."""
    mem = {"a": 1024, "b": 1024, "c": 1024}
    return ReplicaManager(ctl, gpus, 1024, mem, host_memory_mb=host_memory_mb, clock=Clock())


def test_an_evicted_replica_is_offloaded_and_its_next_call_restores_it() -> None:
    """Given a host tier, when services take turns on one GPU, then each is loaded cold once
    and every later turn restores it from host memory: no second cold load."""
    ctl = FakeController()
    m = manager(ctl)
    tiers = []
    for model in ["a", "b", "a", "b", "a"]:
        with m.lease_traced(model, 1, (0,)) as (_, tier, _):
            tiers.append(tier)
    assert tiers == [Tier.COLD, Tier.COLD, Tier.HOST, Tier.HOST, Tier.HOST]
    assert [c for c in ctl.calls if c[0] == "load"] == [("load", "a__dop1__g0"), ("load", "b__dop1__g0")]
    assert ("unload", "a__dop1__g0") not in ctl.calls
    assert m.stats["host_restores"] == 3 and m.stats["offloads"] == 4 and m.stats["loads"] == 2
    assert m.resident() == {(0,): ["a__dop1"]} and m.host_resident() == {(0,): ["b__dop1"]}


def test_without_a_host_tier_an_eviction_unloads_as_before() -> None:
    ctl = FakeController()
    m = manager(ctl, host_memory_mb=0)
    tiers = []
    for model in ["a", "b", "a"]:
        with m.lease_traced(model, 1, (0,)) as (_, tier, _):
            tiers.append(tier)
    assert tiers == [Tier.COLD] * 3
    assert ("unload", "a__dop1__g0") in ctl.calls and not m.host_resident()
    assert m.stats["offloads"] == 0 and m.stats["host_restores"] == 0


def test_a_full_host_budget_drops_the_least_recently_used_host_copy() -> None:
    """Given a host budget of two services, when a third is loaded, then the oldest host-only
    copy is unloaded (dropped) and only that one pays a cold load again."""
    ctl = FakeController()
    m = manager(ctl, host_memory_mb=2048)
    for model in ["a", "b"]:  # a is now host-only, b on the device
        with m.lease(model, 1, (0,)):
            pass
    with m.lease_traced("c", 1, (0,)) as (_, tier, _):
        assert tier is Tier.COLD
    assert ("unload", "a__dop1__g0") in ctl.calls and m.stats["drops"] == 1
    assert m.host_resident() == {(0,): ["b__dop1"]} and m.node.host_used_mb() <= 2048
    with m.lease_traced("b", 1, (0,)) as (_, tier, _):
        assert tier is Tier.HOST


def test_a_failed_restore_unloads_the_replica_and_the_next_call_loads_it_cold() -> None:
    ctl = FakeController()
    m = manager(ctl)
    for model in ["a", "b"]:
        with m.lease(model, 1, (0,)):
            pass
    ctl.fail_restore("a__dop1__g0")
    with pytest.raises(ModelLoadFailed, match="restore"):
        m.acquire("a", 1, (0,))
    assert "a__dop1__g0" not in m.node.replicas and m.stats["restore_failures"] == 1
    with m.lease_traced("a", 1, (0,)) as (_, tier, _):
        assert tier is Tier.COLD


def test_without_a_chunk_a_call_goes_where_its_host_copy_is() -> None:
    """On two GPUs, a service whose host copy is on GPU 1 is restored there, not loaded on 0."""
    node = NodeReplicas(2, 1024, host_memory_mb=8192)
    node.replicas["a__dop1__g1"] = Replica("a__dop1__g1", "a", 1, (1,), 1024, ReplicaState.HOST)
    node.replicas["b__dop1__g0"] = Replica("b__dop1__g0", "b", 1, (0,), 1024, ReplicaState.READY)
    node.replicas["c__dop1__g1"] = Replica("c__dop1__g1", "c", 1, (1,), 1024, ReplicaState.READY)
    p = plan_placement(node, "a", 1, 1024)
    assert p is not None and p.restore and p.chunk == (1,) and p.victims == ("c__dop1__g1",)
    node.replicas["a__dop1__g1"].state = ReplicaState.OFFLOADING
    assert plan_placement(node, "a", 1, 1024, (1,)) is None  # still leaving the GPU: wait


def test_warm_up_fills_the_host_tier_first_with_what_the_gpus_cannot_hold() -> None:
    node = NodeReplicas(1, 1024, host_memory_mb=3072)
    plan = plan_warmup(node, [("a", 1, 1024), ("b", 1, 1024), ("c", 1, 1024), ("d", 1, 1024)])
    assert [(p.replica, p.host) for p in plan] == [
        ("b__dop1__g0", True),
        ("c__dop1__g0", True),
        ("a__dop1__g0", False),
    ]  # d: over the host budget, loaded on its first call


def test_warm_up_through_the_manager_leaves_every_service_a_restore_away() -> None:
    ctl = FakeController()
    m = manager(ctl)
    plan = m.plan_warm([("a", 1), ("b", 1), ("c", 1)])
    for p in [p for p in plan if p.host] + [p for p in plan if not p.host]:
        assert m.warm(p)
    assert m.resident() == {(0,): ["a__dop1"]}
    assert sorted(m.host_resident()[(0,)]) == ["b__dop1", "c__dop1"]
    tiers = []
    for model in ["b", "c", "a"]:
        with m.lease_traced(model, 1, (0,)) as (_, tier, _):
            tiers.append(tier)
    assert tiers == [Tier.HOST] * 3 and m.stats["loads"] == 0


def test_retire_offloads_with_a_host_tier() -> None:
    ctl = FakeController()
    m = manager(ctl)
    with m.lease("a", 1, (0,)):
        pass
    assert m.retire("a__dop1__g0")
    assert m.host_resident() == {(0,): ["a__dop1"]} and ctl.on_host == {"a__dop1__g0"}


def test_the_host_budget_defaults_to_half_the_host_memory_and_must_hold_the_gpus() -> None:
    import os

    half = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2 >> 20
    assert GpuNodeConfig(name="g0", num_gpus=2, gpu_memory_mb=1024).host_budget_mb() == max(half, 2048)
    huge = GpuNodeConfig(name="g0", num_gpus=8, gpu_memory_mb=1 << 20)  # more GPU memory than host RAM
    assert huge.host_budget_mb() == 8 << 20
    assert GpuNodeConfig(name="g0", num_gpus=2, gpu_memory_mb=1024, host_memory_mb=0).host_budget_mb() == 0
    with pytest.raises(ValueError, match="below the node's GPU memory"):
        GpuNodeConfig(name="g0", num_gpus=2, gpu_memory_mb=1024, host_memory_mb=1024)


def test_the_lifecycle_allows_a_round_trip_through_host_memory_only() -> None:
    node = NodeReplicas(1, 1024, host_memory_mb=2048)
    node.replicas["a"] = Replica("a", "a", 1, (0,), 1024, ReplicaState.READY)
    for state in (ReplicaState.OFFLOADING, ReplicaState.HOST, ReplicaState.RESTORING, ReplicaState.READY):
        node.transition("a", state)
    with pytest.raises(ValueError):
        node.transition("a", ReplicaState.RESTORING)  # only a host-only replica is restored
    assert node.used_mb(0) == 1024 and node.host_used_mb() == 1024


def test_warm_up_fills_every_chunk_round_robin_while_the_budget_holds() -> None:
    """Two GPUs with room for one service each: the third gets a host copy first, then every
    service one on each chunk where it has none, round robin, until the budget (weights and
    processes) is spent: a host copy serves calls on its own chunk only."""
    node = NodeReplicas(2, 1024, host_memory_mb=6 * 1536, host_process_mb=512)
    plan = plan_warmup(node, [("a", 1, 1024), ("b", 1, 1024), ("c", 1, 1024)])
    device = [p.replica for p in plan if not p.host]
    host = [p.replica for p in plan if p.host]
    assert device == ["a__dop1__g0", "b__dop1__g1"]
    assert host == ["c__dop1__g0", "a__dop1__g1", "b__dop1__g0", "c__dop1__g1"]  # 6 x 1536 MiB in all


def test_a_replica_is_charged_its_processes_too() -> None:
    node = NodeReplicas(2, 1024, host_memory_mb=4096, host_process_mb=512)
    node.replicas["a"] = Replica("a", "a", 2, (0, 1), 512, ReplicaState.HOST)
    assert node.host_used_mb() == 2 * (512 + 512)
    assert GpuNodeConfig(name="g0", num_gpus=1, gpu_memory_mb=1024).host_process_mb == 512
