"""Sandbox lifetime around CPU worker processes, for real: a restarted worker removes what its
previous incarnation left (and nothing of anyone else's), a reaper removes a killed worker's
containers, and no runner outlives a worker killed while it starts sandboxes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tangram_celery.sandbox.stage import DEFAULT_STAGE_DIR, SandboxScope, scope_of
from tests.fixtures.sandbox import require_sandbox
from tests.integration.lifecycle_support import (
    NODE,
    ROOT,
    cgroup_pids,
    cleanup_scope,
    proc_stat,
    sandbox_cgroups,
    wait_until,
)

pytestmark = pytest.mark.slow


WORKER_SCRIPT = """
import os, sys, time
from tangram_celery.common.config import SandboxConfig
from tangram_celery.sandbox import ExecRequest, SandboxScope, open_sandbox
cfg = SandboxConfig.model_validate_json(sys.argv[1])
box = open_sandbox(cfg, SandboxScope(sys.argv[2]))
res = box.run("t-old", ExecRequest(language="python", code="print('up')"))
assert res.stdout == "up\\n", res
print(box._exit_reaper.proc.pid, flush=True)
time.sleep(3600)
"""


def start_old_incarnation(sandbox: dict[str, Any], scope: str) -> tuple[subprocess.Popen[str], int]:
    """A worker process that opened the backend with `scope` and holds a warm sandbox; returns it
    and its reaper's pid."""
    import json

    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER_SCRIPT, json.dumps(sandbox), scope],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip().isdigit(), f"old incarnation did not start (exit {proc.poll()})"
    return proc, int(line)


def kill_worker_and_its_reaper(proc: subprocess.Popen[str], reaper_pid: int) -> None:
    """SIGKILL the reaper first (as if it had been lost too), then the worker."""
    os.kill(reaper_pid, signal.SIGKILL)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_restarted_namespace_worker_removes_previous_incarnation(tmp_path: Path) -> None:
    """Given a namespace worker SIGKILLed with its reaper, leaving its sandbox cgroups (one still
    holding a process), and another deployment's leftover on the same machine, when a worker
    of the same deployment and node starts, then it kills and removes its predecessor's
    leftovers before serving and leaves the other deployment's alone."""
    from tangram_celery.common.config import SandboxConfig
    from tangram_celery.sandbox import ExecRequest, open_sandbox
    from tangram_celery.sandbox.cgroups import CgroupSet

    sandbox = {"backend": "namespace"}
    require_sandbox(sandbox)
    scope, other = scope_of(tmp_path / "state", NODE), scope_of(tmp_path / "other", NODE)
    proc, reaper = start_old_incarnation(sandbox, scope)
    kill_worker_and_its_reaper(proc, reaper)
    left = sandbox_cgroups(scope)
    assert left, "the old incarnation's cgroups should be left behind"
    # a process that survived in one of them (what an escaped runner would look like), and one
    # in a cgroup of another deployment on this machine
    stray = subprocess.Popen(["sleep", "300"], start_new_session=True)
    foreign = subprocess.Popen(["sleep", "300"], start_new_session=True)
    name = left[0].name
    mine = CgroupSet.existing(name)
    theirs = CgroupSet.create(f"{other}-deadbeef00-x")
    assert mine is not None
    try:
        for cg, p in ((mine, stray), (theirs, foreign)):
            for d in set(cg.dirs.values()):
                (d / "cgroup.procs").write_text(str(p.pid))
        box = open_sandbox(SandboxConfig.model_validate(sandbox), SandboxScope(scope))
        try:
            assert stray.wait(timeout=10) == -signal.SIGKILL
            # (the new worker's own pre-warmed sandboxes may be appearing meanwhile)
            old_names = {d.name for d in left}
            assert not [d for d in sandbox_cgroups(scope) if d.name in old_names], (
                "the predecessor's cgroups are removed"
            )
            assert foreign.poll() is None and sandbox_cgroups(other), "another deployment's are kept"
            res = box.run("t-new", ExecRequest(language="python", code="print('served')"))
            assert res.stdout == "served\n"
            stage = Path(DEFAULT_STAGE_DIR) / scope
            assert sorted(p.name for p in stage.iterdir()) == sorted([box.owner, f"{box.owner}.lock"])
        finally:
            box.close()
    finally:
        foreign.kill()
        foreign.wait()
        theirs.destroy()
        stray.kill()
        stray.wait()


def test_restarted_docker_worker_removes_previous_incarnation(docker_engine: str, tmp_path: Path) -> None:
    """Given a Docker worker SIGKILLed with its reaper, leaving its warm container, and another
    deployment's container on the same engine, when a worker of the same deployment and node
    starts, then the predecessor's container is gone before it serves and the other is kept."""
    import docker

    from tangram_celery.common.config import SandboxConfig
    from tangram_celery.sandbox import ExecRequest, open_sandbox

    sandbox = {"backend": "docker", "docker_host": docker_engine}
    scope, other = scope_of(tmp_path / "state", NODE), scope_of(tmp_path / "other", NODE)
    proc, reaper = start_old_incarnation(sandbox, scope)
    kill_worker_and_its_reaper(proc, reaper)
    client = docker.DockerClient(base_url=docker_engine)
    try:
        assert client.containers.list(
            all=True, ignore_removed=True, filters={"label": f"tangram.scope={scope}"}
        )
        foreign = client.containers.create(
            "tangram-sandbox",
            ["/usr/bin/true"],
            labels={"tangram.scope": other, "tangram.sandbox": "deadbeef00"},
        )
        box = open_sandbox(SandboxConfig.model_validate(sandbox), SandboxScope(scope))
        try:
            left = client.containers.list(
                all=True, ignore_removed=True, filters={"label": f"tangram.scope={scope}"}
            )
            assert left == [], [c.name for c in left]
            foreign.reload()  # still there: raises NotFound otherwise
            assert box.run("t-new", ExecRequest(language="python", code="print(1)")).stdout == "1\n"
        finally:
            box.close()
            foreign.remove(force=True)
    finally:
        client.close()


def test_docker_containers_do_not_outlive_a_killed_worker(docker_engine: str, tmp_path: Path) -> None:
    """Given a Docker worker holding a warm container, when the worker is SIGKILLed, then its
    reaper removes the container."""
    import docker

    sandbox = {"backend": "docker", "docker_host": docker_engine}
    scope = SandboxScope().scope
    proc, reaper = start_old_incarnation(sandbox, scope)
    client = docker.DockerClient(base_url=docker_engine)
    try:
        assert client.containers.list(
            all=True, ignore_removed=True, filters={"label": f"tangram.scope={scope}"}
        )
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_until(
            "the killed worker's containers removed",
            lambda: (
                not client.containers.list(
                    all=True, ignore_removed=True, filters={"label": f"tangram.scope={scope}"}
                )
            ),
        )
        wait_until("the reaper exited", lambda: proc_stat(reaper) is None or proc_stat(reaper)[0] == "Z")  # type: ignore[index]
    finally:
        client.close()


STARTER_SCRIPT = """
import sys
from tangram_celery.common.config import SandboxConfig
from tangram_celery.sandbox import ExecRequest, SandboxScope, open_sandbox
cfg = SandboxConfig.model_validate_json(sys.argv[1])
box = open_sandbox(cfg, SandboxScope(sys.argv[2]))
print(box._exit_reaper.proc.pid, flush=True)
i = 0
while True:  # a new sandbox every time: the worker dies in the middle of some start
    box.run(f"t{i}", ExecRequest(language="python", code="pass"))
    i += 1
"""


# bwrap is killed in its gap now and then: it is a documented limit, not a regression
BWRAP_GAP = pytest.mark.xfail(
    strict=False,
    reason="bubblewrap's gap (README, Known limits; docs/sandbox.md, Lifetime): its "
    "child blocks on an eventfd for its parent before it arms --die-with-parent, so a "
    "bwrap killed in between leaves that child asleep forever (about one run in "
    "three); the built-in launcher, auto's choice, has no such window",
)
LAUNCHERS = [pytest.param("bwrap", marks=BWRAP_GAP), "builtin"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_no_runner_outlives_a_worker_killed_while_sandboxes_start(launcher: str) -> None:
    """Given a worker that starts sandbox after sandbox, when it is SIGKILLed at random moments
    (its reaper killed first, so only the parent-death chain can help), then no runner of it
    survives: every hop from worker to runner arms its parent-death signal and then checks that
    its parent still lives (bwrap alone arms late, which left a runner behind in a soak)."""
    import json
    import random

    sandbox = {"backend": "namespace", "namespace_launcher": launcher}
    require_sandbox(sandbox)
    rng = random.Random(7)
    for round_ in range(8):
        scope = SandboxScope().scope
        proc = subprocess.Popen(
            [sys.executable, "-c", STARTER_SCRIPT, json.dumps(sandbox), scope],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            start_new_session=True,
        )
        assert proc.stdout is not None
        reaper = int(proc.stdout.readline())
        time.sleep(rng.uniform(0.2, 1.5))
        os.kill(reaper, signal.SIGKILL)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        try:
            wait_until(
                f"round {round_}: no process left in the worker's sandboxes",
                lambda: not cgroup_pids(scope),  # noqa: B023 - called at once
                20,
            )
        finally:
            cleanup_scope(scope)  # the dead worker's empty cgroups (its reaper was killed)


DIE_SCRIPT = """
import os, signal, sys
from tangram_celery.common.config import SandboxConfig
from tangram_celery.sandbox import ExecRequest, SandboxScope, open_sandbox
cfg = SandboxConfig.model_validate_json(sys.argv[1])
box = open_sandbox(cfg, SandboxScope(sys.argv[2]))
os.kill(box._exit_reaper.proc.pid, signal.SIGKILL)  # only the parent-death chain can help now
spawn = box._popen

def spawn_then_die(argv, log_path):
    proc = spawn(argv, log_path)
    os.kill(os.getpid(), signal.SIGKILL)  # the launcher has just been exec'd, nothing is armed yet

box._popen = spawn_then_die
box.run("t", ExecRequest(language="python", code="pass"))
"""


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_no_runner_outlives_a_worker_killed_right_after_spawning_it(launcher: str) -> None:
    """Given a worker SIGKILLed the moment its sandbox launcher has been exec'd (before anything
    in the chain could arm a parent-death signal; its reaper killed before), then the sandbox
    never comes up behind it: each hop checks its parent after arming. (With bubblewrap's own
    --die-with-parent, armed only after clone, such a runner lived on as an orphan; bwrap killed
    while it clones still leaves its child asleep now and then: the gap above.)"""
    import json

    sandbox = {"backend": "namespace", "namespace_launcher": launcher}
    require_sandbox(sandbox)
    scope = SandboxScope().scope
    res = subprocess.run(
        [sys.executable, "-c", DIE_SCRIPT, json.dumps(sandbox), scope], cwd=ROOT, timeout=120, check=False
    )
    assert res.returncode == -signal.SIGKILL
    try:
        time.sleep(5)  # long enough for an unguarded launcher to have started its runner
        wait_until("no process in the dead worker's sandbox", lambda: not cgroup_pids(scope), 20)
    finally:
        cleanup_scope(scope)
