"""The restore-cost estimator per (service, tier) and the tiers a GPU node reports (issue 38)."""

from __future__ import annotations

import pytest

from scheduler.gpu_cache import Tier
from scheduler.pools import GpuNode, copy_gpu
from scheduler.resources import ClusterState
from scheduler.restore_cost import SEED_RESTORE_S, RestoreCosts, parse_tier, tier_on


def test_seeds_before_any_sample() -> None:
    """Given nothing observed, each tier costs its documented seed: device 0, host 0.05 s, cold 5 s."""
    costs = RestoreCosts()
    assert [costs.cost_s("rm", t) for t in (Tier.DEVICE, Tier.HOST, Tier.COLD)] == [0.0, 0.05, 5.0]
    assert SEED_RESTORE_S[Tier.COLD] == 5.0


def test_first_sample_replaces_the_seed_then_an_ewma() -> None:
    """Given a cold load of 4 s, the cold estimate of that service is 4 s; a second one of 2 s
    moves it by alpha towards 2 s."""
    costs = RestoreCosts(alpha=0.5)
    costs.observe("rm", Tier.COLD, 4.0)
    assert costs.cost_s("rm", Tier.COLD) == 4.0
    costs.observe("rm", Tier.COLD, 2.0)
    assert costs.cost_s("rm", Tier.COLD) == pytest.approx(3.0)
    assert costs.counts == {Tier.COLD: 2}
    assert costs.learned() == {("rm", Tier.COLD): pytest.approx(3.0)}


def test_an_unseen_service_takes_its_tiers_average_and_others_stay_seeded() -> None:
    """Given host restores of rm observed, sim's host estimate is the tier's average over the
    services seen; its cold estimate is still the seed."""
    costs = RestoreCosts(alpha=1.0)
    costs.observe("rm", Tier.HOST, 0.01)
    assert costs.cost_s("sim", Tier.HOST) == 0.01
    assert costs.cost_s("sim", Tier.COLD) == 5.0


def test_negative_samples_count_as_zero_and_alpha_is_checked() -> None:
    """A clock that stepped back gives no negative cost; alpha outside (0, 1] is refused."""
    costs = RestoreCosts()
    costs.observe("rm", Tier.DEVICE, -0.2)
    assert costs.cost_s("rm", Tier.DEVICE) == 0.0
    with pytest.raises(ValueError, match="alpha"):
        RestoreCosts(alpha=0.0)


def test_wire_words_parse_to_tiers() -> None:
    """The wire's tier words read as tiers; "" (no GPU call) and unknown words as None."""
    assert parse_tier("host") is Tier.HOST and parse_tier("") is None and parse_tier("disk") is None


def test_a_nodes_tier_per_chunk() -> None:
    """Given rm on the device on GPU 0 and kept in host memory on GPU 1, a node that reports a
    host tier says device, host and cold for GPUs 0, 1 and a chunk holding neither; one that
    reports none counts every miss as a host restore (the paper's assumption)."""
    node = GpuNode("g0", 4, 1024, resident={(0,): ["rm"]}, host_resident={(1,): ["rm"]})
    assert node.tier((2,), "rm") is Tier.HOST  # no host tier known
    node.host_tier = True
    assert [node.tier((g,), "rm") for g in range(3)] == [Tier.DEVICE, Tier.HOST, Tier.COLD]
    assert tier_on("rm", (1,), node.resident, node.host_resident) is Tier.HOST
    node.restore_costs = RestoreCosts()
    node.restore_costs.observe("rm", Tier.COLD, 7.0)
    assert node.restore_s((2,), "rm") == 7.0 and node.restore_s((1,), "rm") == 0.05
    twin = copy_gpu(node)
    assert twin.host_resident == node.host_resident and twin.host_resident is not node.host_resident
    assert twin.host_tier and twin.restore_costs is node.restore_costs


def test_learned_host_residency_replaces_the_map_and_leaves_out_device_instances() -> None:
    """Given a report of rm on the device and rm, sim in host memory on GPU 0, the state keeps
    sim alone as host-resident there (rm is on the device); a report without a host tier
    leaves the host map as it was."""
    state = ClusterState(gpu={"g0": GpuNode("g0", 2, 1024)})
    state.attach_gpu_caches(lambda _s, _u: 100)
    state.learn_residency("g0", {(0,): ["rm"]}, 1.0, {(0,): ["rm", "sim"], (1,): []})
    g = state.gpu["g0"]
    assert g.host_tier and g.host_resident == {(0,): ["sim"]} and g.resident == {(0,): ["rm"]}
    state.learn_residency("g0", {}, 2.0)
    assert g.host_resident == {(0,): ["sim"]} and g.resident == {}
