"""`tangram-fast`'s GPU placement with restore tiers (issue 38): a chunk where the service is
kept in host memory beats a cold load, and waiting for a resident chunk beats a slow restore."""

from __future__ import annotations

from scheduler.gpu_cache import Tier
from scheduler.model import Allocation, CostVector, Elastic, QueuedAction, ResourceKind
from scheduler.policies import get_policy
from scheduler.policies.gpu_aware import gpu_candidates
from scheduler.pools import GpuNode
from scheduler.resources import ClusterState
from scheduler.restore_cost import RestoreCosts


def _reward(aid: str, service: str = "rm", t1_s: float = 0.1, units: tuple[int, ...] = (1,)) -> QueuedAction:
    cost = CostVector(ResourceKind.GPU, Elastic(units), gpu_memory_mb=100)
    return QueuedAction(aid, f"t-{aid}", cost, 0.0, t1_s=t1_s, kind=f"reward:{service}", target=service)


def _state(host_tier: bool = True, **host: list[str]) -> ClusterState:
    """One node of 4 GPUs, nothing resident; `host` as `g<gpu>=[services]`."""
    node = GpuNode("g0", 4, 1024, restore_costs=RestoreCosts(), host_tier=host_tier)
    node.host_resident = {(int(k[1:]),): v for k, v in host.items()}
    return ClusterState(gpu={"g0": node})


def _busy(state: ClusterState, gpu: int, service: str, end_s: float) -> None:
    """`service` resident on GPU `gpu`, held by a call expected to end at `end_s`."""
    holder = _reward(f"h{gpu}", service)
    state.gpu["g0"].resident[(gpu,)] = [service]
    state.apply(Allocation(holder.action_id, ResourceKind.GPU, "g0", 1, (gpu,)), holder, 0.0)
    state.expected_end_s[holder.action_id] = end_s


def test_a_host_resident_chunk_is_preferred_to_a_cold_one() -> None:
    """Given rm kept in host memory on GPU 2 of a node with a host tier, an rm call goes to GPU 2
    (a copy), not to the first free GPU (a cold load); without a host tier it goes to GPU 0."""
    [alloc] = gpu_candidates([_reward("a")], _state(g2=["rm"]), 0.0)
    assert alloc.unit_ids == (2,)
    [alloc] = gpu_candidates([_reward("a")], _state(host_tier=False, g2=["rm"]), 0.0)
    assert alloc.unit_ids == (0,)


def test_the_policy_keeps_a_host_resident_chunk_through_its_dp() -> None:
    """`tangram-fast` (its buddy DP re-picks chunks for elastic calls) gives an elastic rm call
    the chunk where rm is kept in host memory."""
    state = _state(g3=["rm"])
    [alloc] = get_policy("tangram-fast").decide([_reward("a", units=(1, 2))], state, 0.0)
    assert alloc.unit_ids == (3,)


def test_waiting_for_a_resident_chunk_beats_a_cold_load_not_a_host_restore() -> None:
    """Given rm resident on GPU 0 and busy for 0.5 s more, and no host copy elsewhere, an rm call
    waits for GPU 0 (a cold load takes 5 s); with a host copy on GPU 1 (0.05 s) it goes there."""
    state = _state()
    _busy(state, 0, "rm", end_s=0.5)
    assert gpu_candidates([_reward("a")], state, 0.0) == []
    state.gpu["g0"].host_resident = {(1,): ["rm"]}
    [alloc] = gpu_candidates([_reward("a")], state, 0.0)
    assert alloc.unit_ids == (1,)


def test_the_learned_cold_cost_decides_and_waiters_queue_up() -> None:
    """Given cold loads of rm learned at 0.2 s, a call no longer waits 0.5 s for the busy
    resident chunk. Learned at 2 s, three calls of 1 s: the first two wait (done after 1.5 s and
    2.5 s, the first waiter counted, against 3 s for a cold load and its call), the third is
    placed cold (it would be done after 3.5 s)."""
    state = _state()
    _busy(state, 0, "rm", end_s=0.5)
    costs = state.gpu["g0"].restore_costs = RestoreCosts(alpha=1.0)
    costs.observe("rm", Tier.COLD, 0.2)
    [alloc] = gpu_candidates([_reward("a")], state, 0.0)
    assert alloc.unit_ids == (1,)
    costs.observe("rm", Tier.COLD, 2.0)
    allocs = gpu_candidates([_reward(a, t1_s=1.0) for a in "abc"], state, 0.0)
    assert [(a.action_id, a.unit_ids) for a in allocs] == [("c", (1,))]


def test_a_holder_past_its_expected_end_is_not_waited_for() -> None:
    """Given rm's resident chunk held by a call already past its expected end, an rm call is
    placed now (cold) rather than waiting for an end nobody can estimate."""
    state = _state()
    _busy(state, 0, "rm", end_s=-1.0)
    [alloc] = gpu_candidates([_reward("a")], state, 0.0)
    assert alloc.unit_ids == (1,)


def test_a_warm_restore_goes_where_the_service_is_kept_in_host_memory() -> None:
    """Given idle GPUs and rm kept in host memory on GPU 2 of a node with a host tier, the warm
    placement of rm restores it on GPU 2 (a copy); without a host tier, on the first GPU."""
    from scheduler.policies.warm_gpu import GpuDemand, warm_placements

    for host_tier, gpu in ((True, 2), (False, 0)):
        state = _state(host_tier=host_tier)
        state.attach_gpu_caches(lambda _s, _u: 100)
        state.gpu["g0"].host_resident[(2,)] = ["rm"]
        [load] = warm_placements(state, GpuDemand({"rm": (1,)}), [], False, 0.0)
        assert (load.service, load.chunk) == ("rm", (gpu,))
