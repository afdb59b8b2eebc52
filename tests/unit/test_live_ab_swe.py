"""benchmarks/live_ab_swe.py: the SWE workload's turns, the checks of each step's known outcome,
and ratios taken within a repetition."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.live_ab_swe import expected, paired, workload
from tangram_celery.common.actions import ActionStatus, TestOutcome
from tangram_celery.swe.tasks import TASKS

pytestmark = pytest.mark.unit

HIDDEN = {t.name: {f: "def test_x():\n    pass\n" for f in t.test_files} for t in TASKS}


def _res(status: str = "ok", exit_code: int = 0, stdout: str = "", tests: int = 0) -> SimpleNamespace:
    outcomes = [TestOutcome(name=f"t{i}", passed=True) for i in range(tests)]
    return SimpleNamespace(status=ActionStatus(status), exit_code=exit_code, stdout=stdout, tests=outcomes)


def test_each_trajectory_runs_the_agents_steps_in_its_tasks_image() -> None:
    """Trajectory k works on task k mod 3, its five steps in order, in that task's image, with
    a positive think time before each; the last is the grade."""
    jobs = workload(6, 1.5, 0, HIDDEN)
    assert len(jobs) == 6
    for k, turns in enumerate(jobs):
        t = TASKS[k % len(TASKS)]
        assert [x.step for x in turns] == ["inspect", "reproduce", "edit", "verify", "reward"]
        assert all(x.task == t and x.action.image == t.image and x.think_s > 0 for x in turns)
        assert turns[-1].action.grade and turns[-1].action.files == HIDDEN[t.name]
    again = workload(6, 1.5, 0, HIDDEN)  # seeded: the same think times
    assert [[x.think_s for x in ts] for ts in again] == [[x.think_s for x in ts] for ts in jobs]


def test_a_step_passes_only_with_its_known_outcome() -> None:
    """Reproduce must fail its tests, verify must pass them, the reward must pass every hidden
    test; anything else is reported with what the step gave."""
    turns = {x.step: x for x in workload(1, 1.0, 0, HIDDEN)[0]}
    fn = turns["inspect"].task.function
    assert expected(turns["inspect"], _res(stdout=f"./x.py:1:def {fn}(word):")) == ""
    assert expected(turns["reproduce"], _res("failed", 1, "1 failed, 3 passed")) == ""
    assert "reproduce" in expected(turns["reproduce"], _res("ok", 0, "4 passed"))
    assert expected(turns["edit"], _res(stdout="edited x.py")) == ""
    assert expected(turns["verify"], _res(stdout="4 passed")) == ""
    assert expected(turns["verify"], _res(stdout="1 failed, 3 passed")) != ""
    assert expected(turns["reward"], _res(tests=1)) == ""
    assert expected(turns["reward"], _res(tests=0)) != ""  # no test ran: no reward
    assert expected(turns["reward"], _res("failed", 1, tests=1)) != ""


def test_ratios_are_taken_within_each_repetition() -> None:
    base = [{"avg": 2.0}, {"avg": 1.0}, {"avg": 3.0}]
    tangram = [{"avg": 1.0}, {"avg": 2.0}, {"avg": 1.5}]
    assert paired(base, tangram, "avg") == {"each": [2.0, 0.5, 2.0], "median": 2.0}
