"""The simulator's execution models of the baselines: pod creation, batched GPU groups, keep-alive."""

from __future__ import annotations

import statistics

import pytest

from scheduler.gpu_cache import GpuCache
from scheduler.policies.static_pod import PodStart
from scheduler.sim import build, make_policy, simulate
from scheduler.sim.gpu_share import BatchedGroup, batch_speedup
from scheduler.sim.pods import PodStarts


def test_pod_binding_is_limited_to_the_scheduler_clients_qps_after_its_burst() -> None:
    """Given QPS 50 and burst 100, when 150 pods are created at once, then the first 100 bind at
    once and the 150th a second later."""
    pods = PodStarts(PodStart(bind_qps=50.0, bind_burst=100))
    binds = [pods.bind_at(0.0) for _ in range(150)]
    assert binds[99] == 0.0
    assert binds[100] == pytest.approx(0.02)
    assert binds[149] == pytest.approx(1.0)


def test_pod_start_up_has_the_given_median_and_99th_percentile() -> None:
    """Given median 1.5 s and p99 5 s, when 20,000 pods start, then the sample matches both."""
    pods = PodStarts(PodStart(start_p50_s=1.5, start_p99_s=5.0))
    draws = sorted(pods.startup_s(f"t{i}") for i in range(20_000))
    assert statistics.median(draws) == pytest.approx(1.5, rel=0.05)
    assert draws[int(0.99 * len(draws))] == pytest.approx(5.0, rel=0.08)
    assert pods.startup_s("t7") == pods.startup_s("t7")  # the same trajectory, the same draw


def test_a_trajectorys_first_action_waits_for_its_pod() -> None:
    """Given pods that take exactly 2 s to start, when coding runs under static-pod, then every
    trajectory's first action pays 2 s plus the exec overhead, later ones only the overhead."""
    sc = build("coding", {"batch": 8})
    pol = make_policy("static-pod", sc, bind_qps=None, start_p50_s=2.0, start_p99_s=2.0)
    result = simulate(sc, pol)
    first = {r.trajectory_id: r for r in sorted(result.records, key=lambda r: r.started_s, reverse=True)}
    assert {round(r.setup_s, 6) for r in first.values()} == {2.1}
    later = [r for r in result.records if first[r.trajectory_id] is not r]
    assert {round(r.setup_s, 6) for r in later} == {0.1}
    assert len(result.records) == sc.num_actions


def test_a_batched_group_runs_concurrent_calls_with_the_batching_gain() -> None:
    """Given two 1 s calls on one group, when a batch amortises 20% of a call, then both end at
    1.8 s (1.11x throughput); with nothing amortised at 2 s (processor sharing)."""
    assert batch_speedup(2, 0.2) == pytest.approx(2 / 1.8)
    for share, end in ((0.2, 1.8), (0.0, 2.0)):
        group = BatchedGroup(share)
        group.add(0.0, "a", 1.0)
        group.add(0.0, "b", 1.0)
        assert group.next_finish_s() == pytest.approx(end)
        assert sorted(group.pop_done(end)) == ["a", "b"]


def test_dedicated_replicas_by_load_with_concurrent_calls_complete_every_action() -> None:
    """Given MOPD at batch 512, when dedicated-gpu runs load-sized TP1 replicas serving concurrent
    calls, then every action completes, none restores, and ACT beats one TP4 group per service
    (whose hot teachers queue)."""
    sc = build("mopd", {"batch": 512})
    strong = simulate(sc, make_policy("dedicated-gpu", sc, tp=1, replicas="load", max_concurrent=None))
    paper = simulate(sc, make_policy("dedicated-gpu", sc))
    assert len(strong.records) == sc.num_actions and strong.unfinished == 0
    assert strong.restores == 0
    assert strong.avg_act_s() < paper.avg_act_s()


def test_cold_start_keep_alive_saves_loads_and_expires_idle_instances() -> None:
    """Given MOPD, when cold-start keeps instances alive, then it loads less often than without;
    with a short window instances expire (unloads), with an infinite one only evictions remain."""
    sc = build("mopd", {"batch": 128})
    none = simulate(sc, make_policy("cold-start", sc))
    short = simulate(sc, make_policy("cold-start", sc, keep_alive_s=1.0))
    kept = simulate(sc, make_policy("cold-start", sc, keep_alive_s=float("inf")))
    assert none.cold_loads == sc.num_actions
    assert kept.cold_loads < short.cold_loads < none.cold_loads
    assert short.unloads > kept.unloads
    assert all(len(r.records) == sc.num_actions for r in (none, short, kept))


def test_an_expired_instance_is_unloaded_and_one_in_use_is_not() -> None:
    """Given a used at 0 and b in use (infinite time), when instances idle since 10 s expire,
    then a goes and b stays."""
    cache = GpuCache(80_000, lambda s, u: 10_000)
    cache.ensure((0,), "a", 0.0)
    cache.ensure((0,), "b", 1.0)
    cache.touch((0,), "b", float("inf"))
    assert cache.expire(10.0) == 1
    assert cache.resident == {(0,): ["b"]}


def test_summary_reports_the_decision_time_distribution() -> None:
    """Given a run, then its summary gives p50/p90/p99/max decision times, in order."""
    s = simulate(build("coding", {"batch": 16}), "tangram-fast").summary()
    assert 0 < s["decision_median_ms"] <= s["decision_p90_ms"] <= s["decision_p99_ms"] <= s["decision_max_ms"]
