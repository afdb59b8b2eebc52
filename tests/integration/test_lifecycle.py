"""Process lifecycle, for real: `tangram up` stops everything on SIGTERM/SIGHUP, nothing outlives
a SIGKILLed one, a failed start leaves nothing behind, and a restarted CPU worker removes what its
previous incarnation left (and nothing of anyone else's)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tangram_celery.sandbox.stage import DEFAULT_STAGE_DIR, SandboxScope, scope_of
from tests.fixtures.sandbox import require_sandbox

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NODE = "n0"
GONE_WITHIN_S = 60.0


# -- process helpers ------------------------------------------------------------------------------
def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _identity(pid: int) -> tuple[int, str] | None:
    """(pid, start time): survives pid reuse checks."""
    st = _stat(pid)
    return None if st is None else (pid, st[19])


def _running(ident: tuple[int, str]) -> bool:
    st = _stat(ident[0])
    return st is not None and st[19] == ident[1] and st[0] not in ("Z", "X")


def descendants(pid: int) -> set[tuple[int, str]]:
    """Every live descendant of `pid` (by parent links in /proc), as (pid, start time)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None:
                parent[int(entry.name)] = int(st[1])
    out: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {c for c, p in parent.items() if p in frontier} - out
        out |= frontier
    return {i for i in (_identity(p) for p in out) if i is not None}


def sandbox_cgroups(scope: str) -> list[Path]:
    """This deployment's sandbox cgroup directories (any controller, v1 or v2)."""
    roots = [Path("/sys/fs/cgroup/tangram"), *Path("/sys/fs/cgroup").glob("*/tangram")]
    return [d for r in roots if r.is_dir() for d in r.iterdir() if d.name.startswith(f"{scope}-")]


def cgroup_pids(scope: str) -> set[int]:
    pids: set[int] = set()
    for d in sandbox_cgroups(scope):
        try:
            pids |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
        except OSError:
            pass
    return pids


def wait_until(what: str, cond: Any, timeout_s: float = GONE_WITHIN_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.2)


# -- a real `tangram up` ---------------------------------------------------------------------------
def write_config(tmp: Path, sandbox: dict[str, Any]) -> Path:
    cfg = {
        "state_dir": str(tmp / "state"),
        "nodes": {"cpu": [{"name": NODE, "cores": 2, "memory_mb": 2048}]},
        "apis": [{"name": "calc", "handler": "tangram_celery.apis.builtin:calculator", "max_concurrency": 2}],
        "sandbox": sandbox,
        "flower": {"port": 0},
    }
    path = tmp / "tangram.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Up:
    """`tangram up -c CONFIG` as a user runs it, in its own session."""

    def __init__(self, config: Path, tmp: Path) -> None:
        self.out = tmp / "up.out"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tangram_celery.cli", "up", "--config", str(config)],
            stdout=self.out.open("wb"),
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"tangram up exited {self.proc.returncode}:\n{self.text()[-3000:]}")
            return "logs:" in self.text()

        wait_until("tangram up ready", ready, timeout_s)

    def text(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def kill_all(self) -> None:
        """Test cleanup: whatever is left of this run, by pid."""
        for pid, _ in descendants(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def up_namespace(tmp_path: Path) -> Iterator[tuple[Up, str]]:
    sandbox = {"backend": "namespace", "default_timeout_s": 20}
    require_sandbox(sandbox)
    up = Up(write_config(tmp_path, sandbox), tmp_path)
    try:
        yield up, scope_of(tmp_path / "state", NODE)
    finally:
        up.kill_all()


def cmdlines(children: set[tuple[int, str]]) -> str:
    out = []
    for pid, _ in children:
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            pass
    return "\n".join(out)


def run_one_action(state_dir: Path, trajectory_id: str) -> None:
    """A code action through the client, leaving the trajectory's sandbox warm (not closed)."""
    from tangram_celery import CodeAction, TangramClient

    url = (state_dir / "broker.url").read_text().strip()
    with TangramClient(url) as client:
        res = client.submit(CodeAction(trajectory_id=trajectory_id, code="print(6 * 7)")).result(timeout=120)
    assert res.status == "ok" and res.stdout.strip() == "42", res


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name)
def test_nothing_outlives_tangram_up(
    up_namespace: tuple[Up, str], tmp_path: Path, sig: signal.Signals
) -> None:
    """Given a running `tangram up` with a warm sandbox, when it gets SIGTERM, SIGHUP or SIGKILL,
    then no process it started (Redis, scheduler, workers, Flower, sandbox launcher, runner) and
    no sandbox cgroup or stage directory of the deployment remains."""
    up, scope = up_namespace
    up.wait_ready()
    run_one_action(tmp_path / "state", "warm-1")
    children = descendants(up.proc.pid)
    assert cgroup_pids(scope), "the action's sandbox runner should be running"
    seen = cmdlines(children)
    for part in ("redis-server", "cli scheduler", "worker cpu", "worker api", "flower", "runner.py"):
        assert part in seen, f"{part!r} not among the children:\n{seen}"

    os.kill(up.proc.pid, sig)
    if sig != signal.SIGKILL:
        assert up.proc.wait(timeout=90) == 0, up.text()[-2000:]
    wait_until(
        f"every child of tangram up gone after {sig.name}",
        lambda: not [c for c in children if _running(c)],
    )
    wait_until("no sandbox runner of the deployment", lambda: not cgroup_pids(scope))
    wait_until("no sandbox cgroup of the deployment", lambda: not sandbox_cgroups(scope))
    wait_until("no stage directory of the deployment", lambda: not (Path(DEFAULT_STAGE_DIR) / scope).exists())
    assert all(not _running((p, s)) for p, s in children)


def test_no_container_outlives_a_killed_tangram_up(docker_engine: str, tmp_path: Path) -> None:
    """Given a running `tangram up` on the Docker backend with a warm container, when it is
    SIGKILLed, then every process it started and the container are gone."""
    import docker

    up = Up(write_config(tmp_path, {"backend": "docker", "docker_host": docker_engine}), tmp_path)
    scope = scope_of(tmp_path / "state", NODE)
    client = docker.DockerClient(base_url=docker_engine)
    try:
        up.wait_ready()
        run_one_action(tmp_path / "state", "warm-1")
        children = descendants(up.proc.pid)
        assert client.containers.list(filters={"label": f"tangram.scope={scope}"})
        os.kill(up.proc.pid, signal.SIGKILL)
        wait_until("every child gone", lambda: not [c for c in children if _running(c)])
        wait_until(
            "the deployment's containers gone",
            lambda: not client.containers.list(all=True, filters={"label": f"tangram.scope={scope}"}),
        )
    finally:
        client.close()
        up.kill_all()


def test_failed_start_leaves_nothing_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given a CPU worker that cannot open a sandbox (no launcher here, as on a fresh machine
    without bubblewrap or root), when a deployment starts, then the start fails naming the reason
    and every process it had started (Redis, scheduler, API worker) is gone."""
    from tangram_celery.config import load_config
    from tangram_celery.deploy import Deployment
    from tangram_celery.errors import TangramError

    monkeypatch.setenv("TANGRAM_PRETEND_MISSING", "bwrap,builtin,docker")
    path = write_config(tmp_path, {"backend": "namespace"})
    dep = Deployment(load_config(path), path, with_flower=True)
    me = os.getpid()
    before = descendants(me)
    with pytest.raises(TangramError, match="built-in launcher is disabled|must run as root"):
        dep.start(progress=False)
    started = descendants(me) - before
    wait_until("every process of the failed start gone", lambda: not [c for c in started if _running(c)], 30)
    assert dep.children == {} and not (tmp_path / "state" / "broker.url").exists()


def test_tangram_up_refuses_to_start_without_a_sandbox(tmp_path: Path) -> None:
    """Given a machine where no sandbox can run, when `tangram up` starts, then it says why and
    what to install, exits 2 and starts nothing."""
    path = write_config(tmp_path, {"backend": "auto"})
    env = dict(os.environ, TANGRAM_PRETEND_MISSING="bwrap,builtin,docker")
    res = subprocess.run(
        [sys.executable, "-m", "tangram_celery.cli", "up", "--config", str(path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert "nothing was started" in res.stderr
    assert "built-in launcher is disabled" in res.stderr or "must run as root" in res.stderr
    assert not (tmp_path / "state" / "broker.url").exists()
    assert not (tmp_path / "state" / "redis").exists()


# -- restarted workers sweep their previous incarnation ----------------------------------------------
WORKER_SCRIPT = """
import os, sys, time
from tangram_celery.config import SandboxConfig
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
    from tangram_celery.config import SandboxConfig
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
            assert not sandbox_cgroups(scope), "the predecessor's cgroups are removed"
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

    from tangram_celery.config import SandboxConfig
    from tangram_celery.sandbox import ExecRequest, open_sandbox

    sandbox = {"backend": "docker", "docker_host": docker_engine}
    scope, other = scope_of(tmp_path / "state", NODE), scope_of(tmp_path / "other", NODE)
    proc, reaper = start_old_incarnation(sandbox, scope)
    kill_worker_and_its_reaper(proc, reaper)
    client = docker.DockerClient(base_url=docker_engine)
    try:
        assert client.containers.list(all=True, filters={"label": f"tangram.scope={scope}"})
        foreign = client.containers.create(
            "tangram-sandbox",
            ["/usr/bin/true"],
            labels={"tangram.scope": other, "tangram.sandbox": "deadbeef00"},
        )
        box = open_sandbox(SandboxConfig.model_validate(sandbox), SandboxScope(scope))
        try:
            left = client.containers.list(all=True, filters={"label": f"tangram.scope={scope}"})
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
        assert client.containers.list(all=True, filters={"label": f"tangram.scope={scope}"})
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_until(
            "the killed worker's containers removed",
            lambda: not client.containers.list(all=True, filters={"label": f"tangram.scope={scope}"}),
        )
        wait_until("the reaper exited", lambda: _stat(reaper) is None or _stat(reaper)[0] == "Z")  # type: ignore[index]
    finally:
        client.close()


STARTER_SCRIPT = """
import sys
from tangram_celery.config import SandboxConfig
from tangram_celery.sandbox import ExecRequest, SandboxScope, open_sandbox
cfg = SandboxConfig.model_validate_json(sys.argv[1])
box = open_sandbox(cfg, SandboxScope(sys.argv[2]))
print(box._exit_reaper.proc.pid, flush=True)
i = 0
while True:  # a new sandbox every time: the worker dies in the middle of some start
    box.run(f"t{i}", ExecRequest(language="python", code="pass"))
    i += 1
"""


@pytest.mark.parametrize("launcher", ["bwrap", "builtin"])
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
            from tangram_celery.sandbox.reaper import remove_cgroups, remove_stage

            remove_cgroups(f"{scope}-")  # the dead worker's empty cgroups (its reaper was killed)
            for d in (Path(DEFAULT_STAGE_DIR) / scope).glob("*"):
                if d.is_dir():
                    remove_stage(d)


DIE_SCRIPT = """
import os, signal, sys
from tangram_celery.config import SandboxConfig
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


@pytest.mark.parametrize("launcher", ["bwrap", "builtin"])
def test_no_runner_outlives_a_worker_killed_right_after_spawning_it(launcher: str) -> None:
    """Given a worker SIGKILLed the moment its sandbox launcher has been exec'd (before anything
    in the chain could arm a parent-death signal; its reaper killed before), then the sandbox
    never comes up behind it: each hop checks its parent after arming. (With bubblewrap's own
    --die-with-parent, armed only after clone, such a runner lived on as an orphan.)"""
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
        from tangram_celery.sandbox.reaper import remove_cgroups, remove_stage

        remove_cgroups(f"{scope}-")
        for d in (Path(DEFAULT_STAGE_DIR) / scope).glob("*"):
            if d.is_dir():
                remove_stage(d)
