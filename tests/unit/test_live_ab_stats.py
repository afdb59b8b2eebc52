"""benchmarks/live_ab_stats.py: pod admission as Kubernetes does it, and Tangram's overhead split."""

from __future__ import annotations

import pytest

from benchmarks.live_ab_stats import PodGate, act_stats, overhead_breakdown, pod_capacity, trajectory_waits


def test_pod_capacity_is_the_tightest_of_cpu_requests_memory_and_max_pods() -> None:
    """A node admits pods while requests fit its cores and memory, at most max-pods."""
    assert pod_capacity(2, 8192, 0.5, 512, 110) == 4
    assert pod_capacity(2, 1024, 0.5, 512, 110) == 2
    assert pod_capacity(64, 1 << 20, 0.5, 512, 110) == 110


def test_pods_are_admitted_first_come_first_served_up_to_capacity() -> None:
    """Trajectories beyond the capacity wait, and get a pod in request order as others end."""
    admitted: list[int] = []
    gate = PodGate(2, admitted.append)
    for k in range(5):
        gate.request(k)
    assert admitted == [0, 1]
    gate.release(1)
    gate.release(0)
    assert admitted == [0, 1, 2, 3]
    assert gate.running == {2, 3}


def test_overhead_splits_act_into_scheduling_waiting_and_execution() -> None:
    """The decision is the scheduler's busy share of the wait plus one round; the dispatch hop
    is dispatched -> claimed; shares are of the summed ACT."""
    parts = [
        {
            "submitted": 0.0,
            "dispatched_s": 1.0,
            "started_s": 1.1,
            "worker_done": 2.2,
            "received": 2.3,
            "exec_s": 1.0,
        },
        {
            "submitted": 0.0,
            "dispatched_s": 0.0,
            "started_s": 0.1,
            "worker_done": 1.2,
            "received": 1.3,
            "exec_s": 1.0,
        },
    ]
    out = overhead_breakdown(parts, {"sum": 0.5, "count": 50}, wall_s=50.0)
    assert out["actions"] == 2
    # decision: 0.01 * 1.0 + 0.01 for the first; capped at its zero wait for the second
    assert out["decision_s"] == pytest.approx(0.01)
    assert out["dispatch_hop_s"] == pytest.approx(0.1)
    assert out["scheduling_share"] == pytest.approx((0.02 + 0.2) / 3.6)
    assert out["exec_share"] == pytest.approx(2.0 / 3.6)
    assert act_stats([3.0, 1.0, 2.0])["p50"] == 2.0


def test_the_longest_wait_and_time_in_actions_of_one_trajectory() -> None:
    """Per trajectory, waits (ACT minus execution, never negative) and ACTs are summed; the
    longest of each is reported (here trajectory 0 waited 1.5 s, trajectory 1 spent 4 s)."""
    out = trajectory_waits([(0, 1.0, 0.5), (0, 1.5, 0.5), (1, 4.0, 4.0), (1, 0.1, 0.2)])
    assert out == {"max_trajectory_wait_s": pytest.approx(1.5), "max_trajectory_act_s": pytest.approx(4.1)}
