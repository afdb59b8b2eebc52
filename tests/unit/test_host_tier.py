"""The host-memory tier of evict on execution (issue 38): the cache's three tiers, and the
simulator charging and counting them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from scheduler.gpu_cache import GpuCache, GpuLoad, Tier
from scheduler.policies import get_policy
from scheduler.sim import ClusterSpec, build, simulate
from scheduler.sim.cli import main
from scheduler.sim.cluster import ExecParams
from scheduler.sim.engine import Simulator
from scheduler.sim.scenarios import MopdParams

pytestmark = pytest.mark.unit


def _cache(host_memory_mb: int | None) -> GpuCache:
    """Two GPUs of 1000 MiB; every instance takes 600 MiB of a GPU and 100 MiB of host memory."""
    return GpuCache(1000, lambda s, u: 600, host_memory_mb=host_memory_mb, host_footprint_mb=lambda s, u: 100)


def test_an_evicted_instance_stays_host_resident_and_restores_from_host() -> None:
    """Given a budget that holds both, when b evicts a from GPU 0, a is host-only there; a's
    next call on GPU 0 is a host restore, on GPU 1 a cold load."""
    cache = _cache(200)
    assert cache.apply(cache.plan("g", (0,), "a"), 1.0) is Tier.COLD
    load = cache.plan("g", (0,), "b")
    assert load.tier is Tier.COLD and load.victims == (((0,), "a"),)
    cache.apply(load, 2.0)
    assert cache.host == {(0,): ["a"]} and cache.resident == {(0,): ["b"]}
    assert cache.tier_of((0,), "a") is Tier.HOST
    assert cache.tier_of((1,), "a") is Tier.COLD
    assert cache.tier_of((0,), "b") is Tier.DEVICE
    assert cache.apply(cache.plan("g", (0,), "a"), 3.0) is Tier.HOST
    assert cache.host == {(0,): ["b"]}


def test_over_the_host_budget_the_least_recently_used_host_only_instance_goes() -> None:
    """Given room for three instances in host memory, when a fourth service is loaded the
    least recently used host-only instance is dropped; device-resident ones never are."""
    cache = _cache(300)
    for t, svc in enumerate(("a", "b", "c")):
        cache.apply(cache.plan("g", (0,), svc), float(t))
    assert cache.host == {(0,): ["a", "b"]} and cache.host_used_mb() == 300
    cache.apply(cache.plan("g", (0,), "d"), 5.0)
    assert cache.host == {(0,): ["b", "c"]}
    assert cache.tier_of((0,), "a") is Tier.COLD


def test_with_no_host_budget_every_miss_is_cold_and_with_none_every_miss_restores() -> None:
    """A zero budget keeps nothing evicted; no budget (None) backs every service up everywhere."""
    zero, unlimited = _cache(0), _cache(None)
    for cache in (zero, unlimited):
        for t, svc in enumerate(("a", "b", "a", "b")):
            cache.apply(cache.plan("g", (0,), svc), float(t))
    assert zero.host == {} and zero.tier_of((0,), "a") is Tier.COLD
    assert unlimited.host == {(0,): ["a"]}
    assert unlimited.tier_of((1,), "never-loaded") is Tier.HOST


def test_a_copy_plans_alike_and_a_hit_is_a_device_load() -> None:
    """A round plans on a copy: same tiers, the original untouched; a hit says DEVICE."""
    cache = _cache(200)
    cache.apply(cache.plan("g", (0,), "a"), 1.0)
    cache.apply(cache.plan("g", (0,), "b"), 2.0)
    scratch = cache.copy()
    load = scratch.plan("g", (0,), "a")
    assert load.tier is Tier.HOST and scratch.apply(load, 3.0) is Tier.HOST
    assert cache.host == {(0,): ["a"]} and scratch.host == {(0,): ["b"]}
    assert GpuLoad("g", (0,), "a", True).tier is Tier.DEVICE
    with pytest.raises(ValueError, match="miss"):
        GpuLoad("g", (0,), "a", False, (), Tier.DEVICE)


def test_learn_replaces_both_maps_in_place() -> None:
    """What the node reports replaces the device and host maps; an instance on the device is
    never also host-only."""
    cache = _cache(None)
    host = cache.host
    cache.learn({(0,): ["a"]}, 1.0, host={(0,): ["a", "b"], (1,): ["c"]})
    assert cache.host is host and host == {(0,): ["b"], (1,): ["c"]}
    assert cache.tier_of((1,), "c") is Tier.HOST


def _mopd(policy: str, host_memory_mb: int | None) -> dict[str, Any]:
    cluster = ClusterSpec(cpu_nodes=0, gpus_total=8, host_memory_mb=host_memory_mb)
    return simulate(build("mopd", {"batch": 96}, cluster=cluster), policy).summary()


@pytest.mark.parametrize(
    ("policy", "avg_act_s", "restores", "warm"),
    [("tangram-fast", 0.9838393840445392, 60, 34), ("tangram-dp", 1.0571325853923945, 37, 0)],
)
def test_an_unlimited_host_budget_simulates_as_before(
    policy: str, avg_act_s: float, restores: int, warm: int
) -> None:
    """With no host budget (the default) every miss is a host restore, and the run is the one
    the simulator gave before the host tier (figures of a98544f)."""
    s = _mopd(policy, None)
    assert s["avg_act_s"] == pytest.approx(avg_act_s, rel=1e-12)
    assert (s["restores"], s["warm_restores"], s["cold_loads"]) == (restores, warm, 0)
    assert s["loads_by_tier"] == {"device": 185 - restores + warm, "host": restores, "cold": 0}


@pytest.mark.parametrize("policy", ["tangram-fast", "tangram-dp"])
def test_a_small_host_budget_brings_cold_loads_and_a_zero_one_makes_every_miss_cold(policy: str) -> None:
    """A node whose host memory holds little more than its GPUs' instances pays cold loads,
    and its ACT rises; with no host memory at all no miss is a host restore."""
    unlimited, small, zero = (_mopd(policy, mb) for mb in (None, 262_144, 0))
    assert small["cold_loads"] > 0 and small["avg_act_s"] > unlimited["avg_act_s"]
    assert zero["restores"] == 0 and zero["cold_loads"] > 0
    assert zero["avg_act_s"] > unlimited["avg_act_s"]


def test_the_policies_see_the_host_tier_as_live() -> None:
    """The simulated nodes show their host-only instances as `GpuNode.host_resident`, with
    the tier bounded, and learn what the restores cost per tier."""
    cluster = ClusterSpec(cpu_nodes=0, gpus_total=8, host_memory_mb=2_097_152)
    sim = Simulator(build("mopd", {"batch": 32}, cluster=cluster), get_policy("tangram-dp"))
    node = sim.state.gpu["gpu0"]
    assert node.host_tier and node.host_resident is sim.caches["gpu0"].host
    assert sum(len(v) for v in node.host_resident.values()) > 10  # the warm-up: more than one per service
    assert sim.caches["gpu0"].host_used_mb() <= 2_097_152
    result = sim.run()
    assert result.cold_loads + result.restores > 0
    learned = {tier for _, tier in sim.restore_costs.learned()}
    assert learned <= {Tier.HOST, Tier.COLD} and learned


def test_the_cli_takes_a_host_budget_per_gpu_node(capsys: pytest.CaptureFixture[str]) -> None:
    """`--cluster host_memory_mb=0` runs MOPD with no host tier: its misses are cold loads."""
    argv = ["run", "--scenario", "mopd", "--set", "batch=8", "--cluster", "gpus_total=8"]
    assert main([*argv, "--cluster", "host_memory_mb=0", "--policy", "tangram-dp"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["loads_by_tier"]["host"] == 0 and summary["cold_loads"] > 0


def _every_copy_mb() -> int:
    """Host memory of every (service, chunk) instance of MOPD's teachers on a node of 8 GPUs:
    15 chunks (8 of one GPU, 4 of two, 2 of four, 1 of eight) per service, each instance its
    weights plus a process per GPU."""
    per_gpu = ExecParams().host_process_mb
    return sum(15 * mb + 4 * 8 * per_gpu for mb in MopdParams().model_mb)


def _warmed(host_memory_mb: int) -> Simulator:
    cluster = ClusterSpec(cpu_nodes=0, gpus_total=8, host_memory_mb=host_memory_mb)
    return Simulator(build("mopd", {"batch": 96}, cluster=cluster), get_policy("tangram-fast"))


def test_the_warm_up_fills_the_host_tier_as_far_as_its_budget_goes() -> None:
    """Given a budget for every (service, chunk) instance, the warm-up puts all 150 in host
    memory; given 2 TiB it fills the budget, round robin: every service on all its one-GPU
    chunks before any two-GPU one, one instance per service a turn."""
    cache = _warmed(_every_copy_mb()).caches["gpu0"]
    assert sum(len(v) for v in cache.host.values()) == 150
    assert cache.host_used_mb() == _every_copy_mb()
    cache = _warmed(2_097_152).caches["gpu0"]
    used = cache.host_used_mb()
    assert used <= 2_097_152 < used + ExecParams().host_footprint_mb(min(MopdParams().model_mb), 1)
    chunks_of: dict[str, list[tuple[int, ...]]] = {}
    for c, services in cache.host.items():
        for s in services:
            chunks_of.setdefault(s, []).append(c)
    assert len(chunks_of) == 10
    for chunks in chunks_of.values():
        sizes = sorted(len(c) for c in chunks)
        assert sizes[0] == 1 and (max(sizes) == 1 or sizes.count(1) == 8)
    counts = [len(c) for c in chunks_of.values()]
    assert max(counts) - min(counts) <= 1  # one more per service a turn


@pytest.mark.parametrize("policy", ["tangram-fast", "tangram-dp"])
def test_with_every_instance_in_host_memory_no_call_loads_cold(policy: str) -> None:
    """Given a host budget that holds every (service, chunk) instance, the warm-up fills it and
    no call pays a cold load; given a tight one (256 GiB) cold loads appear."""
    full, tight = (_mopd(policy, mb) for mb in (_every_copy_mb(), 262_144))
    assert full["cold_loads"] == 0 and full["restores"] > 0
    assert tight["cold_loads"] > 0


def test_a_budget_holding_every_instance_with_the_tier_hidden_simulates_as_unlimited() -> None:
    """Given a host budget that holds every (service, chunk) instance, the costs charged are
    those of unlimited host memory: with the tier hidden from the policy (`host_tier` off) the
    run is the unlimited one, call for call. (With the tier shown, `tangram-fast` waits for
    busy resident chunks by the learned costs and restores less; docs/simulator.md.)"""
    cluster = ClusterSpec(cpu_nodes=0, gpus_total=8, host_memory_mb=_every_copy_mb())
    sim = Simulator(build("mopd", {"batch": 384}, cluster=cluster), get_policy("tangram-fast"))
    for node in sim.state.gpu.values():
        node.host_tier = False
    hidden = sim.run().summary()
    unlimited = simulate(
        build("mopd", {"batch": 384}, cluster=ClusterSpec(cpu_nodes=0, gpus_total=8)), "tangram-fast"
    ).summary()
    assert hidden["avg_act_s"] == unlimited["avg_act_s"]
    assert hidden["loads_by_tier"] == unlimited["loads_by_tier"] and hidden["cold_loads"] == 0
