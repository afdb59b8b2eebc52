"""The correctness suite (HumanEval + problems in every other language) through each sandbox backend."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tangram_celery.common.actions import LANGUAGES, ActionStatus
from tangram_celery.sandbox import ExecRequest
from tests.problems import Problem, all_problems

TIMEOUT_S = 10.0
COMPILE_TIMEOUT_S = 30.0  # javac / rustc start slowly on a loaded 2-core machine (1-2 s idle)


def solve(box: Any, problems: list[Problem], core: int, broken: bool) -> list[tuple[str, Any]]:
    """Run each problem's reference (or broken) solution in one trajectory pinned to `core`."""
    traj = f"suite-{core}-{'broken' if broken else 'ref'}"
    out = []
    for p in problems:
        req = ExecRequest(
            language=p.language,
            code=p.broken if broken else p.reference,
            test_cases=p.tests,
            timeout_s=TIMEOUT_S,
            compile_timeout_s=COMPILE_TIMEOUT_S,
            cores=(core,),
        )
        out.append((p.name, box.run(traj, req)))
    box.close_trajectory(traj)
    return out


def run_suite(box: Any, broken: bool) -> list[tuple[str, Any]]:
    problems = all_problems()
    halves = [problems[0::2], problems[1::2]]
    with ThreadPoolExecutor(2) as pool:
        parts = list(pool.map(lambda i: solve(box, halves[i], i, broken), range(2)))
    return parts[0] + parts[1]


def test_suite_has_at_least_100_problems_in_every_language() -> None:
    """Given the problem data, when loaded, then >= 100 problems covering every language."""
    problems = all_problems()
    assert len(problems) >= 100
    assert {p.language for p in problems} == set(LANGUAGES)
    assert all(p.tests and p.reference != p.broken for p in problems)


def test_every_reference_solution_passes(sandbox_backend: Any, toolchains: list[str]) -> None:
    """Given every problem's reference, when run sandboxed on 2 cores, then all are OK."""
    results = run_suite(sandbox_backend, broken=False)
    bad = [(n, r.status, r.tests[:1], r.stderr[-300:]) for n, r in results if r.status is not ActionStatus.OK]
    assert not bad


def test_every_broken_solution_fails(sandbox_backend: Any, toolchains: list[str]) -> None:
    """Given every problem's broken solution, when run sandboxed, then none is OK."""
    results = run_suite(sandbox_backend, broken=True)
    passed = [n for n, r in results if r.status is ActionStatus.OK]
    assert not passed
    assert all(r.status in (ActionStatus.FAILED, ActionStatus.TIMEOUT) for _, r in results)
