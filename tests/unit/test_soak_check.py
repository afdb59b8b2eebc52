"""benchmarks/soak_check.py: the soak's counts, verification and kill attribution, on synthetic logs."""

from __future__ import annotations

from typing import Any

from benchmarks.soak_check import Expected, InFlight, Kill, summarize, verify


def code_result(stdout: str = "5\n", status: str = "ok", attempts: int = 1, **kw: Any) -> dict[str, Any]:
    return {"status": status, "stdout": stdout, "tests": [], "attempts": attempts, "act_s": 0.1, **kw}


def test_outputs_are_verified_per_kind() -> None:
    """Code is checked for status, exact stdout and per-test verdicts; rewards for the exact score;
    API calls for their answer; any difference is reported as wrong."""
    suite = Expected("code", status="failed", tests={"a": True, "b": False})
    got = {
        "status": "failed",
        "stdout": "",
        "tests": [{"name": "a", "passed": True}, {"name": "b", "passed": False}],
    }
    assert verify(suite, got) is None
    got["tests"][1]["passed"] = True  # type: ignore[index]
    assert "tests" in str(verify(suite, got))
    assert verify(Expected("code", stdout="5\n"), code_result("6\n")) is not None
    assert verify(Expected("code", stdout="5\n"), code_result(status="error")) is not None
    assert verify(Expected("reward", score=1.0), {"status": "ok", "output": {"score": 1.0}}) is None
    assert verify(Expected("reward", score=1.0), {"status": "ok", "output": {"score": 0.0}}) is not None
    assert verify(Expected("api", tag="t1"), {"status": "ok", "output": {"tag": "t2"}}) is not None


def test_losses_duplicates_and_attempts_are_counted_per_kind() -> None:
    """An action without a result is lost; two run-log records, two pushed results or two API
    executions are duplicates; attempts above one land in the histogram."""
    expected = {
        "c1": Expected("code", stdout="5\n"),
        "c2": Expected("code", stdout="5\n"),
        "c3": Expected("code", stdout="5\n"),
        "a1": Expected("api", tag="t1"),
        "a2": Expected("api", tag="t2"),
        "r1": Expected("reward", score=0.0),
    }
    results = {
        "c1": code_result(attempts=2),
        "c2": code_result(),
        "a1": {"status": "ok", "output": {"tag": "t1"}},
        "a2": {"status": "ok", "output": {"tag": "t2"}},
        "r1": {"status": "ok", "output": {"score": 0.0}},
    }
    log = [{"action_id": i, "attempt": 1} for i in ("c2", "c2", "a1", "a2", "r1")] + [
        {"action_id": "c1", "attempt": 2}
    ]
    out = summarize(expected, results, log, ["t1", "t2", "t2"], {"r1": 2, "a1": 1}, [])
    code, api, reward = out["kinds"]["code"], out["kinds"]["api"], out["kinds"]["reward"]
    assert (code["submitted"], code["completed"], code["lost"], code["lost_ids"]) == (3, 2, 1, ["c3"])
    assert code["duplicated_completions"] == 1 and code["duplicated_ids"] == ["c2"]
    assert code["attempts_histogram"] == {"1": 1, "2": 1}
    assert code["attempts"] == {"1": 1, "2": 1, "3+": 0}
    assert api["duplicated_executions"] == 1 and api["duplicated_ids"] == ["a2"]
    assert reward["duplicated_completions"] == 1, "two results pushed for one action"
    assert api["duplicated_completions"] == 0, "one leftover push is a result read from the hash"
    assert out["totals"]["retried"] == 1 and out["totals"]["lost"] == 1


def test_kills_name_the_work_they_hit_and_its_fate() -> None:
    """A worker kill hits only what was running on that worker; a scheduler kill hits all in
    flight; each hit action is followed to retried, completed, wrong or lost."""
    expected = {i: Expected("code", stdout="5\n") for i in ("x", "y", "z", "w")}
    results = {
        "x": code_result(attempts=2),
        "y": code_result(),
        "w": code_result("7\n", received_s=9.5),
    }
    flight = [
        InFlight("x", "code", "running", "cpu-n0@h-1-a", 1),
        InFlight("y", "code", "queued", "", 0),
        InFlight("z", "code", "running", "cpu-n0@h-1-a", 1),
        InFlight("w", "code", "running", "api-rec@h-2-b", 1),
    ]
    out = summarize(
        expected, results, [], [], {}, [Kill(10.0, "worker-cpu-n0", flight), Kill(20.0, "scheduler", flight)]
    )
    worker, sched = out["kills"]
    assert (worker["hit"], worker["hit_running"]) == (2, 2)
    assert worker["fates"] == {"retried": 1, "lost": 1}
    assert sched["hit"] == 4 and sched["fates"] == {"retried": 1, "completed": 1, "lost": 1, "wrong": 1}
    assert out["totals"]["kills_that_hit_running_work"] == 2
    assert out["by_victim"]["worker-cpu-n0"] == {
        "kills": 1,
        "hit": 2,
        "hit_running": 2,
        "retried": 1,
        "completed": 0,
        "lost": 1,
        "wrong": 0,
    }
    assert out["by_victim"]["redis"]["kills"] == 0
    # w completed 0.5 s before no scheduler kill (the kill came 10.5 s later): its missing log
    # record is not explained by a lost log buffer
    assert out["kinds"]["code"]["missing_from_run_log_unexplained"] == 3
