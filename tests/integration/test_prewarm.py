"""Ready sandboxes, one-shot runs and sandbox generations, on both backends (sandbox API)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from tangram_celery.common.actions import ActionStatus
from tangram_celery.sandbox import ExecRequest

LIST = "import os; print(sorted(f for f in os.listdir('.') if f != 'main.py'))"


def tid() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def req(code: str, **kw: Any) -> ExecRequest:
    return ExecRequest(language="python", code=code, timeout_s=20, **kw)


def test_a_new_trajectory_gets_a_ready_sandbox_bound_at_hand_out(sandbox_factory: Any) -> None:
    """Given a worker with two ready sandboxes (each on one core, default memory), when a
    new trajectory runs on core 1 with 48 MiB, then it runs in a ready one, sees only core 1,
    cannot use more than its memory, and the pool is refilled in the background."""
    box = sandbox_factory(prewarm=2)
    assert box.ready.wait_full(60)
    traj = tid()
    res = box.run(traj, req("import os; print(sorted(os.sched_getaffinity(0)))", cores=(1,), memory_mb=48))
    assert (res.status, res.stdout.strip(), res.sandbox_reset) == (ActionStatus.OK, "[1]", False)
    assert box.ready.handed_out == 1
    hog = box.run(traj, req("b = bytearray(200 << 20); print(len(b))", cores=(1,), memory_mb=48))
    assert hog.status is ActionStatus.MEMORY_LIMIT, hog
    assert box.ready.wait_full(60)
    assert box.ready.started >= 3


def test_an_idle_worker_keeps_a_burst_of_new_trajectories_off_sandbox_starts(sandbox_factory: Any) -> None:
    """Given a worker with prewarm 1 and ready_idle 4 (ready_max 4), idle, when its pool has grown to 4
    ready sandboxes and four new trajectories start at once, then each runs in a ready one
    (none started on its critical path) and the pool, with 4 sandboxes held, refills to 1."""
    from concurrent.futures import ThreadPoolExecutor

    box = sandbox_factory(prewarm=1, ready_max=4, ready_idle=4)
    deadline = time.monotonic() + 120
    while len(box.ready) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(box.ready) == 4
    started = box.ready.started
    trajs = [tid() for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        out = list(pool.map(lambda t: box.run(t, req("print(1)", cores=(0,), memory_mb=64)), trajs))
    assert [(r.status, r.stdout.strip(), r.sandbox_reset) for r in out] == [(ActionStatus.OK, "1", False)] * 4
    assert box.ready.handed_out == 4
    assert box.ready.wait_full(60)
    time.sleep(0.5)  # idle: it would grow now if the held sandboxes did not count
    assert len(box.ready) == 1 and box.ready.started == started + 1
    for t in trajs:
        box.close_trajectory(t)


def test_a_one_shot_run_leaves_nothing_behind(sandbox_factory: Any) -> None:
    """Given a backend, when two one-shot runs each list the workdir and write a file, then
    neither sees a file, and no trajectory sandbox is left."""
    box = sandbox_factory(prewarm=1)
    before = set(box.trajectories())
    for _ in range(2):
        res = box.run_once(req(LIST + "; open('x', 'w').write('1')", cores=(0,), memory_mb=64))
        assert (res.status, res.stdout.strip()) == (ActionStatus.OK, "[]"), res
    assert set(box.trajectories()) == before
    assert all(t in before for t, _ in box.held())


def test_concurrent_one_shot_runs_without_ready_sandboxes(sandbox_factory: Any) -> None:
    """Given no ready sandboxes, when six one-shot runs start at once, then each gets a sandbox
    of its own and all succeed."""
    from concurrent.futures import ThreadPoolExecutor

    box = sandbox_factory(prewarm=0)
    with ThreadPoolExecutor(6) as pool:
        out = list(
            pool.map(lambda i: box.run_once(req(f"print({i})", cores=(i % 2,), memory_mb=64)), range(6))
        )
    assert [(r.status, r.stdout.strip()) for r in out] == [(ActionStatus.OK, str(i)) for i in range(6)]


def test_sandbox_generations(sandbox_factory: Any) -> None:
    """Given a trajectory sandbox of generation g1, when a close names an older generation it
    stays; an action of a new generation g2 (pinned anew) gets a fresh sandbox without a reset;
    an action expecting g3 that is not there gets a fresh one with sandbox_reset; a close of
    the current generation removes it."""
    box = sandbox_factory(prewarm=1)
    traj = tid()
    write = LIST + "; open('f', 'w').write('1')"
    first = box.run(traj, req(write, cores=(0,), memory_mb=64, sandbox_gen="g1", new_sandbox=True))
    assert (first.stdout.strip(), first.sandbox_reset) == ("[]", False)
    box.close_trajectory(traj, "g0")
    same = box.run(traj, req(LIST, cores=(0,), memory_mb=64, sandbox_gen="g1"))
    assert (same.stdout.strip(), same.sandbox_reset) == ("['f']", False)
    assert (traj, "g1") in box.held()
    anew = box.run(traj, req(write, cores=(0,), memory_mb=64, sandbox_gen="g2", new_sandbox=True))
    assert (anew.stdout.strip(), anew.sandbox_reset) == ("[]", False)
    lost = box.run(traj, req(LIST, cores=(0,), memory_mb=64, sandbox_gen="g3"))
    assert (lost.stdout.strip(), lost.sandbox_reset) == ("[]", True)
    box.close_trajectory(traj, "g3")
    deadline = time.monotonic() + 30
    while traj in box.trajectories() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert traj not in box.trajectories()
    gone = box.run(traj, req(LIST, cores=(0,), memory_mb=64, sandbox_gen="g3"))
    assert gone.sandbox_reset


def test_a_dead_sandbox_is_replaced_and_reported(sandbox_factory: Any) -> None:
    """Given a trajectory whose runner was killed from the host, when its next action runs,
    then it runs in a fresh sandbox and says sandbox_reset."""
    box = sandbox_factory(prewarm=1)
    traj = tid()
    assert box.run(traj, req("open('f', 'w').write('1')", cores=(0,), memory_mb=64)).status is ActionStatus.OK
    h = box._handles[traj]
    box._destroy(h)  # the sandbox dies under the worker (OOM-killed runner, engine restart)
    res = box.run(traj, req(LIST, cores=(0,), memory_mb=64))
    assert (res.status, res.stdout.strip(), res.sandbox_reset) == (ActionStatus.OK, "[]", True)
