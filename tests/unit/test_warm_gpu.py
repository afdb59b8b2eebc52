"""Warm GPU placement: services restored onto free GPU memory before their calls come."""

from __future__ import annotations

from scheduler.gpu_cache import GpuCache
from scheduler.model import Allocation, ResourceKind
from scheduler.policies import get_policy
from scheduler.policies.warm_gpu import GpuDemand, oversized, warm_placements
from scheduler.pools import GpuNode
from scheduler.resources import ClusterState
from scheduler.sim import build
from scheduler.sim.engine import Simulator

GIB = 1024


def _state(nodes: int = 2, memory_mb: int = 80 * GIB) -> ClusterState:
    state = ClusterState(gpu={f"g{i}": GpuNode(f"g{i}", 8, memory_mb) for i in range(nodes)})
    state.attach_gpu_caches(lambda _s, units: 16 * GIB // units + 4 * GIB)
    return state


def test_every_seeded_service_gets_a_free_chunk_of_its_share() -> None:
    """Given 16 idle GPUs and 4 configured services, when placing, then each service is
    restored once, on its own 4-GPU chunk (16 / 4), without evicting anything."""
    state = _state()
    demand = GpuDemand({s: (1, 2, 4, 8) for s in "abcd"})
    loads = warm_placements(state, demand, [], False, 0.0)
    assert sorted(ld.service for ld in loads) == list("abcd")
    assert all(len(ld.chunk) == 4 and not ld.victims and not ld.hit for ld in loads)
    assert len({(ld.pool, ld.chunk) for ld in loads}) == 4


def test_nothing_is_placed_while_a_call_waits_or_under_load() -> None:
    """Given a waiting GPU call, or fewer than half the GPUs free, then no warm restore starts."""
    state = _state()
    demand = GpuDemand({"a": (1, 2, 4, 8)})
    assert warm_placements(state, demand, [], True, 0.0) == []
    busy = [Allocation(f"x{i}", ResourceKind.GPU, f"g{i}", 8, tuple(range(8))) for i in range(1)]
    busy.append(Allocation("y", ResourceKind.GPU, "g1", 2, (0, 1)))
    assert warm_placements(state, demand, busy, False, 0.0) == []


def test_a_resident_service_with_a_free_chunk_is_left_alone() -> None:
    """Given a service already resident on a free chunk, then it is not restored again, and a
    service that fits nowhere without eviction is not placed."""
    state = _state(nodes=1, memory_mb=24 * GIB)
    cache: GpuCache = state.gpu_cache["g0"]
    cache.preload(tuple(range(8)), "a")
    demand = GpuDemand({"a": (8,), "b": (8,)})
    assert warm_placements(state, demand, [], False, 0.0) == []  # b: 8 + 4 GiB more per GPU > 24


def test_demand_is_learned_and_decays() -> None:
    """Given calls started for one service, then it ranks first; unseen demand decays away."""
    d = GpuDemand({"a": (1,), "b": (1,)}, half_life_s=10.0)
    d.observe("b", (1,), 1.0, n=3)
    assert d.ranked(1.0) == ["b", "a"]
    assert d.ranked(1000.0) == []


def test_low_load_mopd_calls_find_their_service_warm() -> None:
    """Given MOPD at a low batch, when tangram-fast places services ahead of demand, then
    almost no call waits for a restore and the average ACT drops."""
    sc = build("mopd", {"batch": 32})
    warm = Simulator(sc, get_policy("tangram-fast")).run()
    cold = Simulator(sc, get_policy("tangram-fast", warm=False)).run()
    assert warm.unfinished == 0 and len(warm.records) == sc.num_actions
    assert warm.restores - warm.warm_restores < cold.restores / 2
    assert warm.avg_act_s() < cold.avg_act_s()


def test_an_instance_the_load_outgrew_is_retired_while_free() -> None:
    """Given a service resident on all 8 GPUs of a node while 6 of its calls run or wait at once
    on average, then that instance is named for unloading; on a busy chunk it is left alone."""
    state = _state(nodes=1)
    state.gpu_cache["g0"].preload(tuple(range(8)), "a")
    demand = GpuDemand({"a": (1, 2, 4, 8)})
    demand.concurrent(0.0, {"a": 6})
    inst = [("g0", tuple(range(8)), "a")]
    assert oversized(state, demand, inst, 0.0) == inst
    state.gpu["g0"].free.discard(3)
    assert oversized(state, demand, inst, 0.0) == []


def test_the_paper_policy_neither_lends_nor_warms() -> None:
    """tangram-dp and fcfs-min stay the paper's algorithm: no loans, no warm placements."""
    for name in ("tangram-dp", "fcfs-min"):
        ex = get_policy(name).execution
        assert not ex.lend_cores and not ex.warm_gpu
    ex = get_policy("tangram-fast").execution
    assert ex.lend_cores and ex.warm_gpu and not ex.live_gaps()
