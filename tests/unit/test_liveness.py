"""The liveness pass as a pure function (scheduler.service.liveness.assess): which actions go
again, and when, from the workers' heartbeats and the actions' owners."""

from __future__ import annotations

from scheduler.model import Allocation, ResourceKind
from scheduler.service.liveness import LivenessPolicy, assess


def _cpu(aid: str, node: str) -> Allocation:
    return Allocation(aid, ResourceKind.CPU, node, 1, (0,))


def test_an_unclaimed_action_goes_again_at_once_when_a_worker_that_may_have_taken_it_died() -> None:
    """Given a pool whose worker stopped beating 6 s ago (a restarted one beats), actions
    dispatched there and not claimed go again at once if that worker was alive when they were
    dispatched (it may have taken the message with it), and not if they were dispatched after it
    was surely gone (`dead_after_s` past its last beat) or to a pool that lost no worker; the
    claim timeout still sends any action again. The scheduler's clock is not Redis's."""
    policy = LivenessPolicy(dead_after_s=5.0, claim_timeout_s=20.0)
    server_now, local_now = 1000.0, 2000.0  # the same instant in the two clocks
    workers = {
        "old": (994.0, "cpu:n0"),  # stopped beating 6 s ago
        "new": (999.5, "cpu:n0"),  # its restart
        "n1": (999.8, "cpu:n1"),
    }
    owners = {
        "before": ("dispatched", None, 1, 1993.0),  # before the old worker's last beat
        "while": ("dispatched", None, 1, 1998.5),  # it may still have lived then
        "after": ("dispatched", None, 1, 1999.5),  # after it was surely gone
        "claimed": ("running", "new", 1, 1993.0),
        "other": ("dispatched", None, 1, 1993.0),  # on a pool that lost no worker
        "timeout": ("dispatched", None, 2, 1975.0),  # 25 s unclaimed, on that pool
    }
    running = {aid: _cpu(aid, "n1" if aid in ("other", "timeout") else "n0") for aid in owners}
    plan = assess(policy, server_now, workers, running, list(owners.values()), local_now)
    assert plan.retry == [("before", "", 1), ("while", "", 1), ("timeout", "", 2)]
    assert plan.alive == {"new", "n1"} and not plan.offline and not plan.reroute
    # once forgotten (silent for `forget_after_s`), a dead worker no longer counts
    old = {**workers, "old": (1000.0 - policy.forget_after_s - 1, "cpu:n0")}
    again = assess(policy, server_now, old, running, list(owners.values()), local_now)
    assert again.retry == [("timeout", "", 2)]
