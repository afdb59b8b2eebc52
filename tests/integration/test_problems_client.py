"""The correctness suite through the client API, on a live deployment (scheduler + CPU worker)."""

from __future__ import annotations

from tangram_celery import ActionStatus, CodeAction
from tests.problems import all_problems


def test_problem_suite_through_the_client(client, toolchains: list[str]) -> None:
    """Given every problem, when its reference and its broken solution are submitted through
    TangramClient, then every reference is ok and every broken one is not."""
    problems = all_problems()
    actions = []
    for p in problems:
        for kind, code in (("ref", p.reference), ("broken", p.broken)):
            actions.append(
                CodeAction(
                    trajectory_id=f"{kind}-{p.name}"[:128].replace("/", "_"),
                    language=p.language,
                    code=code,
                    test_cases=p.tests,
                    memory_mb=128,  # enough for rustc and javac too (rustc fails at 64)
                    timeout_s=10,
                    compile_timeout_s=30,  # javac / rustc on a loaded 2-core machine
                )
            )
    # 20 trajectories' worth of memory at a time: submit in waves and close what finished.
    results = []
    for lo in range(0, len(actions), 20):
        wave = actions[lo : lo + 20]
        handles = client.submit_many(wave)
        results += [h.result(timeout=600) for h in handles]
        for a in wave:
            client.close_trajectory(a.trajectory_id)
    refs = [r for a, r in zip(actions, results, strict=True) if a.trajectory_id.startswith("ref-")]
    broken = [r for a, r in zip(actions, results, strict=True) if a.trajectory_id.startswith("broken-")]
    assert len(refs) == len(problems) >= 100
    assert [r.action_id for r in refs if r.status is not ActionStatus.OK] == []
    assert [r.action_id for r in broken if r.status is ActionStatus.OK] == []
