"""The simulator: runs to completion, honours limits, is deterministic, replays traces."""

from __future__ import annotations

import io

import pytest

from scheduler.duration import Amdahl
from scheduler.gpu_cache import GpuCache
from scheduler.model import ResourceKind
from scheduler.sim import build, simulate
from scheduler.sim.cli import main
from scheduler.sim.cpu_share import SharedNode
from scheduler.sim.trace import read_workload, trajectories_from_action_log, write_workload
from scheduler.sim.workload import SimAction


@pytest.mark.parametrize(
    ("scenario", "policy"),
    [
        ("coding", "tangram-fast"),
        ("coding", "tangram-dp"),
        ("coding", "static-pod"),
        ("coding", "fixed-dop-4"),
        ("mopd", "tangram-fast"),
        ("mopd", "dedicated-gpu"),
        ("mopd", "cold-start"),
        ("deepsearch", "tangram-fast"),
        ("deepsearch", "per-trajectory-api"),
    ],
)
def test_every_action_completes(scenario: str, policy: str) -> None:
    """Given a small scenario, when simulated, then every action has exactly one record."""
    sc = build(scenario, {"batch": 16})
    result = simulate(sc, policy)
    assert len(result.records) == sc.num_actions
    assert result.unfinished == 0
    assert all(r.ended_s >= r.started_s >= r.submitted_s for r in result.records)


def test_quota_control_never_exceeds_the_provider_limit() -> None:
    """Given a tight search quota, when tangram-fast runs DeepSearch, then no call is rejected,
    while per-trajectory calls are rejected by the provider."""
    params = {"batch": 64, "api_quota_per_window": 60, "api_max_concurrency": 8}
    sc = build("deepsearch", params)
    assert simulate(sc, "tangram-fast").rejected_calls == 0
    assert simulate(sc, "per-trajectory-api").rejected_calls > 0


def test_same_seed_gives_the_same_result() -> None:
    """Given one scenario, when simulated twice, then the average ACT is identical."""
    a = simulate(build("coding", {"batch": 16}), "tangram-fast").avg_act_s()
    b = simulate(build("coding", {"batch": 16}), "tangram-fast").avg_act_s()
    assert a == b


def test_trace_roundtrip_replays_identically() -> None:
    """Given a recorded workload, when read back and replayed, then the result is identical."""
    sc = build("mopd", {"batch": 24})
    buf = io.StringIO()
    write_workload(sc, buf)
    again = read_workload(io.StringIO(buf.getvalue()))
    assert simulate(again, "tangram-fast").avg_act_s() == pytest.approx(
        simulate(sc, "tangram-fast").avg_act_s()
    )


def test_action_log_becomes_replayable_trajectories() -> None:
    """Given a live log of two actions, when converted, then think time and T1 are recovered."""
    log = [
        {
            "trajectory_id": "t",
            "kind": "tests",
            "key": "cpu",
            "submitted_s": 15.0,
            "started_s": 16.0,
            "ended_s": 26.0,
            "units": 4,
            "allowed": [1, 2, 4],
        },
        {
            "trajectory_id": "t",
            "kind": "shell",
            "key": "cpu",
            "submitted_s": 10.0,
            "started_s": 10.0,
            "ended_s": 12.0,
            "units": 1,
        },
    ]
    (traj,) = trajectories_from_action_log(log, {"tests": Amdahl(1.0)})
    assert [s.action.kind for s in traj.steps] == ["shell", "tests"]
    assert traj.steps[1].think_s == pytest.approx(3.0)
    assert traj.steps[1].action.t1_s == pytest.approx(40.0)


def test_processor_sharing_splits_cores_equally_under_contention() -> None:
    """Given 1 core and two 1-thread 10 s jobs, when shared, then both finish at 20 s."""
    node = SharedNode(1.0)
    job = SimAction("shell", ResourceKind.CPU, (1,), 10.0)
    node.add(0.0, "a", job, 1, 4)
    node.add(0.0, "b", job, 1, 4)
    assert node.next_finish_s() == pytest.approx(20.0)
    assert sorted(node.pop_done(20.0)) == ["a", "b"]


def test_gpu_cache_evicts_the_least_recently_used_instance() -> None:
    """Given a and b (30 GB each) on one 80 GB GPU and a used last, when c (30 GB) comes, then b
    is evicted and a stays."""
    cache = GpuCache(80_000, lambda s, u: 30_000)
    assert cache.ensure((0,), "a", 0.0) == (False, [])
    assert cache.ensure((0,), "b", 1.0) == (False, [])
    assert cache.ensure((0,), "a", 2.0) == (True, [])
    assert cache.ensure((0,), "c", 3.0) == (False, [((0,), "b")])
    assert cache.resident == {(0,): ["a", "c"]}


def test_cli_runs_a_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    """Given the sim CLI, when asked to run a tiny scenario, then it prints a summary line."""
    assert main(["run", "--scenario", "coding", "--set", "batch=4", "--policy", "fcfs-min"]) == 0
    assert '"policy": "fcfs-min"' in capsys.readouterr().out


def test_cli_passes_policy_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    """Given `name:key=value,...`, when run, then the policy is built with those parameters and
    the summary names the policy as given."""
    spec = "static-pod:packing=binpack,max_pods=2"
    assert main(["run", "--scenario", "coding", "--set", "batch=4", "--policy", spec]) == 0
    assert f'"policy": "{spec}"' in capsys.readouterr().out


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("static-pod:packing=random", "packing must be one of"),
        ("static-pod:nope=1", "unexpected keyword argument 'nope'"),
        ("static-pod:packing", "wants key=value"),
        ("no-such-policy", "unknown policy"),
    ],
)
def test_cli_rejects_bad_policy_specs_before_running(
    spec: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Given a bad policy name or parameter after a good one, when run, then it stops with a
    message naming it before simulating anything."""
    with pytest.raises(SystemExit, match=message):
        main(["run", "--scenario", "coding", "--set", "batch=4", "--policy", "fcfs-min", "--policy", spec])
    assert capsys.readouterr().out == ""


def test_policy_spec_reads_config_mappings() -> None:
    """Given a config entry as a mapping, then its name and parameters are read from it."""
    from scheduler.sim.cli import policy_label, policy_spec

    assert policy_spec({"name": "static-pod", "packing": "binpack"}) == ("static-pod", {"packing": "binpack"})
    assert policy_spec("fixed-dop-4") == ("fixed-dop-4", {})
    assert (
        policy_label("static-pod", {"packing": "binpack", "max_pods": 2})
        == "static-pod:packing=binpack,max_pods=2"
    )
    with pytest.raises(ValueError, match="needs a 'name'"):
        policy_spec({"packing": "binpack"})
