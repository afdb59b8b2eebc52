"""Process lifecycle of `tangram up`, for real: it stops everything on SIGTERM/SIGHUP, nothing
outlives a SIGKILLed one (processes, runners, cgroups, containers), and a failed start or a
machine without a sandbox leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tangram_celery.sandbox.stage import DEFAULT_STAGE_DIR, scope_of
from tests.fixtures.sandbox import require_sandbox
from tests.integration.lifecycle_support import (
    NODE,
    ROOT,
    cgroup_pids,
    descendants,
    running,
    sandbox_cgroups,
    wait_until,
)

pytestmark = pytest.mark.slow


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
    for part in ("redis-server", "cli scheduler", "worker cpu", "worker api", "flower", "tangram_runner"):
        assert part in seen, f"{part!r} not among the children:\n{seen}"

    os.kill(up.proc.pid, sig)
    if sig != signal.SIGKILL:
        assert up.proc.wait(timeout=90) == 0, up.text()[-2000:]
    wait_until(
        f"every child of tangram up gone after {sig.name}",
        lambda: not [c for c in children if running(c)],
    )
    wait_until("no sandbox runner of the deployment", lambda: not cgroup_pids(scope))
    wait_until("no sandbox cgroup of the deployment", lambda: not sandbox_cgroups(scope))
    wait_until("no stage directory of the deployment", lambda: not (Path(DEFAULT_STAGE_DIR) / scope).exists())
    assert all(not running((p, s)) for p, s in children)


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
        assert client.containers.list(ignore_removed=True, filters={"label": f"tangram.scope={scope}"})
        os.kill(up.proc.pid, signal.SIGKILL)
        wait_until("every child gone", lambda: not [c for c in children if running(c)])
        wait_until(
            "the deployment's containers gone",
            lambda: (
                not client.containers.list(
                    all=True, ignore_removed=True, filters={"label": f"tangram.scope={scope}"}
                )
            ),
        )
    finally:
        client.close()
        up.kill_all()


def test_failed_start_leaves_nothingrunning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given a CPU worker that cannot open a sandbox (no launcher here, as on a fresh machine
    without bubblewrap or root), when a deployment starts, then the start fails naming the reason
    and every process it had started (Redis, scheduler, API worker) is gone."""
    from tangram_celery.common.config import load_config
    from tangram_celery.common.errors import TangramError
    from tangram_celery.deploy import Deployment

    monkeypatch.setenv("TANGRAM_PRETEND_MISSING", "bwrap,builtin,docker")
    path = write_config(tmp_path, {"backend": "namespace"})
    dep = Deployment(load_config(path), path, with_flower=True)
    me = os.getpid()
    before = descendants(me)
    with pytest.raises(TangramError, match=r"built-in launcher is disabled|must run as root"):
        dep.start(progress=False)
    started = descendants(me) - before
    wait_until("every process of the failed start gone", lambda: not [c for c in started if running(c)], 30)
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
