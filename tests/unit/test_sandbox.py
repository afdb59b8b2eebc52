"""Sandbox logic that needs no sandbox: statuses, payloads, cgroup files, pytest rewriting."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tangram_celery.common.actions import ActionStatus, TestCase
from tangram_celery.common.config import SandboxConfig
from tangram_celery.sandbox import ExecRequest, open_sandbox
from tangram_celery.sandbox.cgroups import CgroupSet, _field
from tangram_celery.sandbox.limits import Limits, classify, counter_delta, to_result
from tangram_celery.sandbox.runner_request import runner_request
from tangram_runner.protocol import Facts
from tangram_runner.suite import rewrite

COUNTERS = {"oom_kill": 0, "pids_max": 0}


@pytest.mark.parametrize(
    ("facts", "delta", "expected"),
    [
        ({"exit_code": 0}, COUNTERS, ActionStatus.OK),
        ({"exit_code": 2}, COUNTERS, ActionStatus.FAILED),
        ({"exit_code": None, "timed_out": True}, COUNTERS, ActionStatus.TIMEOUT),
        ({"timed_out": True}, {"oom_kill": 0, "pids_max": 9}, ActionStatus.PIDS_LIMIT),
        ({"exit_code": -9, "killed": True}, {"oom_kill": 1, "pids_max": 0}, ActionStatus.MEMORY_LIMIT),
        ({"exit_code": 1, "disk_full": True}, COUNTERS, ActionStatus.DISK_LIMIT),
        ({"output_capped": True, "exit_code": None}, COUNTERS, ActionStatus.OUTPUT_LIMIT),
        ({"compile_failed": True, "exit_code": 1}, COUNTERS, ActionStatus.FAILED),
        # no cgroup counters (rlimit fallback): the runner's error strings decide
        ({"exit_code": 1, "fork_failed": True}, {}, ActionStatus.PIDS_LIMIT),
        ({"exit_code": 1, "memory_error": True}, {}, ActionStatus.MEMORY_LIMIT),
        ({"exit_code": -9, "killed": True}, {}, ActionStatus.MEMORY_LIMIT),
        # with counters, a SIGKILL the kernel's OOM killer did not do is a plain failure
        ({"exit_code": -9, "killed": True}, COUNTERS, ActionStatus.FAILED),
    ],
)
def test_classify_maps_facts_to_one_status(facts: dict, delta: dict, expected: ActionStatus) -> None:
    """Given runner facts and counter deltas, when classified, then the expected status."""
    assert classify(Facts.from_dict(facts), delta, has_tests=False) is expected


def test_failed_test_case_makes_action_failed() -> None:
    """Given exit 0 but one failing test, when converted, then FAILED with the outcomes kept."""
    req = ExecRequest(language="python", code="", test_cases=[TestCase(name="a", assert_code="1")])
    facts = {"exit_code": None, "tests": [{"name": "a", "passed": False, "detail": "x"}], "exec_s": 0.5}
    res = to_result(Facts.from_dict(facts), COUNTERS, req)
    assert res.status is ActionStatus.FAILED and res.tests[0].detail == "x" and res.exec_s == 0.5


def test_counter_delta_is_empty_without_counters() -> None:
    """Given missing counters on either side, when diffed, then {} (meaning: unknown)."""
    assert counter_delta(None, COUNTERS) == {}
    assert counter_delta({"oom_kill": 1, "pids_max": 2}, {"oom_kill": 3, "pids_max": 2}) == {
        "oom_kill": 2,
        "pids_max": 0,
    }


def test_payload_carries_limits_and_rlimits_only_in_fallback() -> None:
    """Given a request, when turned into a runner payload, then caps and cores are set, and
    rlimits appear only when cgroups are unavailable."""
    req = ExecRequest(language="c", code="x", cores=(2, 3), memory_mb=64, env={"A": "b"})
    p = runner_request(req, Limits(max_output_bytes=2048), ["/opt/tangram/site"]).to_dict()
    assert (p["cores"], p["max_output_bytes"], p["env"]) == ([2, 3], 2048, {"A": "b"})
    assert "rlimits" not in p
    p = runner_request(req, Limits(use_rlimits=True, pids_limit=32), []).to_dict()
    assert p["rlimits"] == {"AS": 64 << 20, "NPROC": 32}


def test_payload_gives_the_compile_phase_its_floor_of_memory() -> None:
    """Given a floor of 512 MiB, then a C action of 64 MiB compiles under 512 and runs under 64;
    one of 1024 compiles under 1024; Python, and C without code, compile nothing (their own)."""
    c64 = ExecRequest(language="c", code="x", memory_mb=64)
    p = runner_request(c64, Limits(), [], 512).to_dict()
    assert (p["compile_memory_mb"], p["memory_mb"]) == (512, 64)
    big = ExecRequest(language="c", code="x", memory_mb=1024)
    assert runner_request(big, Limits(), [], 512).compile_memory_mb == 1024
    py = ExecRequest(language="python", code="x", memory_mb=64)
    assert runner_request(py, Limits(), [], 512).compile_memory_mb == 64
    bare = ExecRequest(language="c", code=None, memory_mb=64, test_command="true")
    assert runner_request(bare, Limits(), [], 512).compile_memory_mb == 64


BOOT = "/usr/bin/python3 -E -s /r/pytest_boot.py --tangram-fd 3 --tangram-path /opt/tangram/site"


@pytest.mark.parametrize(
    ("cmd", "expected"),
    [
        ("pytest -q", f"{BOOT} -n 4 -q"),
        ("python -m pytest tests", f"{BOOT} -n 4 tests"),
        ("python3.11 -m pytest tests", f"{BOOT} -n 4 tests"),
        ("cd sub && pytest", f"cd sub && {BOOT} -n 4"),
        ("pytest a; exec py.test b", f"{BOOT} -n 4 a; exec {BOOT} -n 4 b"),
        ("make test", "make test"),
        ("echo pytest-like", "echo pytest-like"),
    ],
)
def test_pytest_commands_run_under_the_harness_with_n_workers(
    cmd: str, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a test command, when rewritten for DoP 4, then every pytest call becomes the
    harness's bootstrap (report channel on fd 3) with `-n 4`."""
    monkeypatch.setattr("sys.executable", "/usr/bin/python3")
    assert rewrite(cmd, 4, "/r", ["/opt/tangram/site"]) == expected


@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        ({"exit_code": 0, "suite": {"passed": True}, "tests": [{"name": "t", "passed": True}]}, "ok"),
        ({"exit_code": 0, "suite": {"passed": False, "detail": "no report"}}, "failed"),
        ({"exit_code": 0, "setup_error": "cannot write files entry 'a/b'"}, "failed"),
        ({"exit_code": None, "timed_out": True, "compile": {"timed_out": True}}, "timeout"),
    ],
)
def test_suite_verdict_and_setup_errors_decide_over_exit_status(facts: dict, expected: str) -> None:
    """Given exit status 0 but no passing verdict from the harness (or a files entry that could
    not be written), when classified, then FAILED; a passing verdict is OK."""
    assert classify(Facts.from_dict(facts), COUNTERS, has_tests=False) == expected


def test_compile_phase_is_reported_apart() -> None:
    """Given facts with a compile phase, when converted, then the result carries it apart from the
    run's output."""
    req = ExecRequest(language="c", code="int main(){}", compile_timeout_s=3.0)
    compile_out = {"exit_code": 0, "stdout": "", "stderr": "warn", "exec_s": 0.2, "timed_out": False}
    res = to_result(Facts.from_dict({"exit_code": 0, "stdout": "run", "compile": compile_out}), COUNTERS, req)
    assert res.status is ActionStatus.OK and res.stdout == "run"
    assert res.compile is not None and (res.compile.stderr, res.compile.exec_s) == ("warn", 0.2)
    assert runner_request(req, Limits(), []).compile_timeout_s == 3.0


def test_cgroup_v1_counters_and_binding(tmp_path: Path) -> None:
    """Given fake v1 cgroup dirs, when cores are bound and counters read, then files match."""
    dirs = {}
    for c in ("cpu", "cpuset", "memory", "pids"):
        dirs[c] = tmp_path / c
        dirs[c].mkdir()
    (dirs["memory"] / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    (dirs["pids"] / "pids.events").write_text("max 7\n")
    cg = CgroupSet(1, dirs)
    cg.bind_cores((3, 1))
    assert (dirs["cpuset"] / "cpuset.cpus").read_text() == "1,3"
    assert (dirs["cpu"] / "cpu.cfs_quota_us").read_text() == "200000"
    assert cg.counters() == {"oom_kill": 3, "pids_max": 7}


def test_rebinding_writes_only_what_changes(tmp_path: Path) -> None:
    """Given a v1 set bound to core 0, when it is bound to core 1 (as many cores), then only
    the cpuset is written; when bound to cores 0 and 1, the quota follows."""
    dirs = {c: tmp_path / c for c in ("cpu", "cpuset", "memory", "pids")}
    for d in dirs.values():
        d.mkdir()
    cg = CgroupSet(1, dirs)
    cg.bind_cores((0,))
    (dirs["cpu"] / "cpu.cfs_quota_us").unlink()
    cg.bind_cores((1,), was=(0,))
    assert (dirs["cpuset"] / "cpuset.cpus").read_text() == "1"
    assert not (dirs["cpu"] / "cpu.cfs_quota_us").exists()
    cg.bind_cores((0, 1), was=(1,))
    assert (dirs["cpuset"] / "cpuset.cpus").read_text() == "0,1"
    assert (dirs["cpu"] / "cpu.cfs_quota_us").read_text() == "200000"


def test_cgroup_v2_binding(tmp_path: Path) -> None:
    """Given a fake v2 cgroup dir, when bound to 1 core with 256 MiB, then cpu.max and memory.max."""
    cg = CgroupSet(2, dict.fromkeys(("cpu", "cpuset", "memory", "pids"), tmp_path))
    cg.bind_cores((0,))
    cg.set_memory(256)
    assert (tmp_path / "cpu.max").read_text() == "100000 100000"
    assert (tmp_path / "memory.max").read_text() == str(256 << 20)
    assert cg.counters() == {"oom_kill": 0, "pids_max": 0}


def test_cgroup_cpu_time_and_weight(tmp_path: Path) -> None:
    """Given fake cgroup dirs, the CPU time used is a counter where the kernel accounts it (v1
    `cpuacct.usage` in ns, v2 `cpu.stat` usage_usec), and a relative CPU weight is written on
    the kernel's scale (v1 `cpu.shares` of 1024, v2 `cpu.weight` of 100), clamped, and read back."""
    v1 = {c: tmp_path / "v1" / c for c in ("cpu", "cpuset", "memory", "pids", "cpuacct")}
    for d in v1.values():
        d.mkdir(parents=True)
    (v1["cpuacct"] / "cpuacct.usage").write_text("2500000000\n")
    cg = CgroupSet(1, v1)
    assert cg.counters()["cpu_us"] == 2_500_000
    cg.set_cpu_weight(0.25)
    assert (v1["cpu"] / "cpu.shares").read_text() == "256"
    assert cg.cpu_weight() == 0.25
    cg.set_cpu_weight(None)
    assert (v1["cpu"] / "cpu.shares").read_text() == "1024"
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.stat").write_text("usage_usec 1500\nuser_usec 1000\n")
    cg = CgroupSet(2, dict.fromkeys(("cpu", "cpuset", "memory", "pids"), v2))
    assert cg.counters()["cpu_us"] == 1500
    cg.set_cpu_weight(0.001)
    assert (v2 / "cpu.weight").read_text() == "1"
    cg.set_cpu_weight(None)
    assert cg.cpu_weight() == 1.0


def test_field_parses_key_value_lines() -> None:
    """Given a cgroup events file, when a key is looked up, then its value (0 when absent)."""
    assert _field("low 0\nhigh 2\noom_kill 5\n", "oom_kill") == 5
    assert _field("", "max") == 0


def test_open_sandbox_auto_falls_back_without_docker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given no reachable engine, when 'auto' is asked for, then the namespace backend is built."""
    import tangram_celery.sandbox.backends as sb
    import tangram_celery.sandbox.namespace as ns

    built: list[str] = []

    class Fake:
        name = "namespace"

        def __init__(self, cfg: SandboxConfig, scope: object = None, egress_deny: object = ()) -> None:
            built.append(cfg.backend)

    monkeypatch.setattr(sb, "docker_reachable", lambda url: False)
    monkeypatch.setattr(ns, "NamespaceSandbox", Fake)
    box = open_sandbox(SandboxConfig(backend="auto", docker_host="unix:///nonexistent.sock"))
    assert box.name == "namespace" and built == ["auto"]


def test_runner_protocol_round_trips_and_refuses_another_version() -> None:
    """Given a request and facts, when sent as JSON and read back, then they are equal; a request
    of another protocol version is refused."""
    import json

    from tangram_runner.protocol import PhaseFacts, RunRequest, SuiteFacts, TestFacts

    req = runner_request(ExecRequest(language="c", code="x", cores=(1,)), Limits(use_rlimits=True), [])
    wire = json.loads(json.dumps(req.to_dict()))
    assert RunRequest.from_dict(wire) == req and wire["v"] == 1
    with pytest.raises(ValueError, match="version"):
        RunRequest.from_dict({**wire, "v": 0})
    facts = Facts(
        exit_code=0,
        tests=(TestFacts("t", True),),
        compile=PhaseFacts(exit_code=0, cached=True),
        suite=SuiteFacts(passed=True, collected=1),
        rolled_back=("a",),
    )
    assert Facts.from_dict(json.loads(json.dumps(facts.to_dict()))) == facts
    assert (
        "runner_error" not in facts.to_dict() and Facts.from_dict({"runner_error": "x"}).runner_error == "x"
    )


def test_exec_request_of_an_action_and_its_order() -> None:
    """Given a code action and the scheduler's order, when made a request, then it carries the
    action's program and limits, the order's cores, sandbox generation and share weight, and
    the job's verifier group only under the job scope."""
    from tangram_celery.common.actions import CodeAction
    from tangram_celery.common.wire import SandboxOrder, TaskOrder

    action = CodeAction(trajectory_id="t", job_id="j", code="print(1)", memory_mb=256, timeout_s=3)
    order = TaskOrder(
        action_id="a1",
        kind="cpu",
        pool="p",
        units=2,
        unit_ids=(4, 5),
        shares=True,
        cpu_weight=0.5,
        sandbox=SandboxOrder(gen="g2", new=True),
    )
    req = ExecRequest.of(action, order)
    assert (req.code, req.memory_mb, req.timeout_s, req.cores) == ("print(1)", 256, 3, (4, 5))
    assert (req.action_id, req.sandbox_gen, req.new_sandbox, req.cpu_weight) == ("a1", "g2", True, 0.5)
    assert req.verifier_group == "" and ExecRequest.of(action, order, (7,), "job").verifier_group == "job:j"
    assert ExecRequest.of(action, order, (7,)).cores == (7,)


def test_exec_request_takes_every_field_it_shares_with_the_action_by_name() -> None:
    """Given an action with files, tests and stdin, when made a request, then every field the
    request declares under an action's field name holds the action's value, and changing the
    request's containers leaves the action as it was."""
    from tangram_celery.common.actions import CodeAction, TestCase
    from tangram_celery.common.wire import TaskOrder

    action = CodeAction(
        trajectory_id="t",
        language="c",
        code="int main(){}",
        files={"a.txt": "x"},
        fetch_files=["a.txt"],
        test_cases=[TestCase(name="c1", stdin="1", expected_stdout="1")],
        stdin="in",
        compile_timeout_s=4,
        image="tangram-swe/task:bug",
    )
    req = ExecRequest.of(action, TaskOrder(action_id="a", kind="cpu", pool="p", units=1, unit_ids=(0,)))
    shared = [f.name for f in dataclasses.fields(ExecRequest) if f.name in CodeAction.model_fields]
    assert "image" in shared and len(shared) >= 12
    assert all(getattr(req, name) == getattr(action, name) for name in shared)
    req.files["b.txt"] = "y"
    req.test_cases.clear()
    assert action.files == {"a.txt": "x"} and len(action.test_cases) == 1
