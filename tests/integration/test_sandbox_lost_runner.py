"""A sandbox whose runner died a moment before an action reached it (namespace backend, real
sandboxes): the liveness check just before the action cannot see that yet, so the request
finds no runner. Nothing of the action ran, so it runs in another sandbox instead of ending
`error`; the result says `sandbox_reset` only when the trajectory lost files."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tangram_celery.common.actions import ActionStatus
from tangram_celery.sandbox import ExecRequest
from tests.fixtures.docker import namespace_sandbox
from tests.integration.lifecycle_support import is_sandbox_runner, status_field


@pytest.fixture(scope="module")
def box() -> Iterator[Any]:
    yield from namespace_sandbox(prewarm=1, ready_max=1)  # the next taker's sandbox is known


@pytest.fixture
def blind(box: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The window made wide: the liveness checks (the worker's and the ready pool's) see a
    sandbox whose runner was just killed as alive, as they do until its launcher has exited."""
    monkeypatch.setattr(box, "_alive", lambda h: h.ref is not None)
    monkeypatch.setattr(box.ready, "_alive", lambda h: h.ref is not None)
    return box


def req(code: str) -> ExecRequest:
    return ExecRequest(language="python", code=code, timeout_s=20, cores=(0,), memory_mb=128)


def kill_runner(h: Any) -> None:
    """SIGKILL the runner (PID 1 of the sandbox's pid namespace) and wait until it is gone."""
    assert h.cgroups is not None
    runners = [int(pid) for pid in h.cgroups.procs() if is_sandbox_runner(int(pid))]
    assert len(runners) == 1, f"runners in the sandbox's cgroup: {runners}"
    runner = runners[0]
    os.kill(runner, signal.SIGKILL)
    deadline = time.monotonic() + 10
    # until reaped ([]: no status any more), or a zombie (dead, not yet reaped)
    while status_field(runner, "State")[:1] not in ([], ["Z"]) and time.monotonic() < deadline:
        time.sleep(0.01)


def ready_one(box: Any) -> Any:
    assert box.ready.wait_full(60)
    return box.ready._ready[0]


def test_a_new_trajectory_whose_ready_sandbox_died_runs_in_another(blind: Any) -> None:
    """Given the ready sandbox a new trajectory is about to take, whose runner was just killed,
    when the trajectory's first action runs, then it runs in another sandbox and passes, and it
    is not reported reset (the trajectory had no files to lose)."""
    kill_runner(ready_one(blind))
    t = f"n-{uuid.uuid4().hex[:6]}"
    res = blind.run(t, req("print(6 * 7)"))
    assert (res.status, res.stdout, res.sandbox_reset) == (ActionStatus.OK, "42\n", False), res
    assert blind.run(t, req("print('again')")).stdout == "again\n"
    blind.close_trajectory(t)


def test_a_trajectory_whose_sandbox_died_between_actions_gets_a_fresh_one(blind: Any) -> None:
    """Given a trajectory that wrote a file, whose sandbox's runner was then killed, when its
    next action runs, then it runs in a fresh sandbox, passes, sees no file and says so
    (`sandbox_reset`)."""
    t = f"b-{uuid.uuid4().hex[:6]}"
    assert blind.run(t, req("open('f', 'w').write('x')")).status is ActionStatus.OK
    kill_runner(blind._handles[t])
    res = blind.run(t, req("import os; print(os.path.exists('f'))"))
    assert (res.status, res.stdout, res.sandbox_reset) == (ActionStatus.OK, "False\n", True), res
    blind.close_trajectory(t)


def test_a_one_shot_action_whose_ready_sandbox_died_runs_in_another(blind: Any) -> None:
    """Given the ready sandbox a one-shot action is about to take, whose runner was just
    killed, when the action runs, then it runs in another sandbox and passes."""
    kill_runner(ready_one(blind))
    res = blind.run_once(req("print('once')"))
    assert (res.status, res.stdout) == (ActionStatus.OK, "once\n"), res


def test_an_action_whose_runner_dies_while_it_runs_is_reported_not_rerun(blind: Any) -> None:
    """Given an action that reached its runner, when the runner dies while it runs, then the
    action is not run again (it may have had effects): it ends `error`, reset, as before."""
    t = f"r-{uuid.uuid4().hex[:6]}"
    assert blind.run(t, req("print(1)")).status is ActionStatus.OK
    h = blind._handles[t]
    killer = threading.Timer(1.0, kill_runner, args=(h,))
    killer.start()
    try:
        res = blind.run(t, req("import time; print('ran', flush=True); time.sleep(10)"))
    finally:
        killer.join()
    assert res.status is ActionStatus.ERROR and "runner lost" in res.detail, res
    assert res.sandbox_reset, res
    blind.close_trajectory(t)
