"""Host-side pieces that need no sandbox: scopes, container names, the stage directory, the
runner socket, the parent-death exec wrapper, the launcher choice."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tangram_celery.common import lifeline
from tangram_celery.common.errors import SandboxError
from tangram_celery.sandbox.docker import container_name
from tangram_celery.sandbox.link import RunnerGone, call_runner
from tangram_celery.sandbox.stage import SandboxScope, Stage, scope_of


def test_scope_is_stable_per_state_dir_and_node(tmp_path: Path) -> None:
    """The same state dir and node give the same scope (a restart finds its predecessor);
    another node or another state dir gives another one."""
    a = scope_of(tmp_path / "state", "n0")
    assert a == scope_of(str(tmp_path / "state"), "n0") and len(a) == 16
    assert len({a, scope_of(tmp_path / "state", "n1"), scope_of(tmp_path / "other", "n0")}) == 3
    # node names may contain '-', so one scope must never be a prefix of another's names
    assert not SandboxScope(a).prefix.startswith(SandboxScope(scope_of(tmp_path / "state", "n")).prefix)


@pytest.mark.parametrize(
    "a, b", [("a:b", "a-b"), ("x" * 60 + "1", "x" * 60 + "2"), ("t/1", "t_1"), ("é", "-")]
)
def test_container_names_do_not_collide(a: str, b: str) -> None:
    """Trajectory ids that sanitise or truncate alike still get distinct, valid container names."""
    who = SandboxScope()
    na, nb = container_name(who, a), container_name(who, b)
    assert na != nb
    for n in (na, nb):
        assert n.isascii() and all(c.isalnum() or c in "_.-" for c in n) and len(n) <= 128


def test_stage_refuses_a_directory_others_can_write(tmp_path: Path) -> None:
    """A stage directory writable by others could feed code into every sandbox: refused."""
    base = tmp_path / "stage"
    base.mkdir()
    os.chmod(base, 0o777)
    with pytest.raises(SandboxError, match="writable by no one else"):
        Stage(base, SandboxScope())


def test_stage_layout_locks_and_stale_incarnations(tmp_path: Path) -> None:
    """A stage is root-only and holds the runner and launcher; a live incarnation (lock held)
    is not stale, a dead one (lock released) is, and removing it leaves the live one alone."""
    scope = SandboxScope().scope
    live = Stage(tmp_path / "stage", SandboxScope(scope))
    dead = Stage(tmp_path / "stage", SandboxScope(scope))
    me = Stage(tmp_path / "stage", SandboxScope(scope))
    try:
        assert oct(os.stat(me.dir).st_mode & 0o777) == "0o700"
        assert (me.runner / "tangram_runner" / "runner.py").is_file() and me.launcher.is_file()
        assert me.alive(live.who.incarnation) and me.alive(dead.who.incarnation)
        os.close(dead._lock_fd)  # as if its process had died
        dead._lock_fd = -1
        assert me.stale_incarnations() == [dead.who.incarnation]
        me.remove_incarnation(dead.who.incarnation)
        assert not dead.dir.exists() and live.dir.exists() and me.stale_incarnations() == []
    finally:
        live.close()
        me.close()
    assert not (tmp_path / "stage" / scope).exists()


def test_call_runner_does_not_follow_a_planted_link(tmp_path: Path) -> None:
    """The runner's socket dir is shared with the sandbox: a symlink in place of the socket
    (pointing at another socket of the host) is not followed."""
    target = tmp_path / "host.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(target))
    srv.listen(1)
    link = tmp_path / "runner.sock"
    link.symlink_to(target)
    try:
        with pytest.raises(RunnerGone):
            call_runner(link, {"op": "ping"}, 1.0)
    finally:
        srv.close()


def test_exec_wrapper_refuses_to_run_for_a_dead_parent() -> None:
    """The wrapper arms the parent-death signal, then checks the parent: started for a parent
    that is not (or no longer) its parent, it exits without running the program."""
    wrapper = lifeline.wrapper_argv(["/bin/echo", "ran"], ppid=1)
    res = subprocess.run(wrapper, capture_output=True, text=True, timeout=30)
    assert (res.returncode, res.stdout) == (lifeline.EXIT_ORPHANED, "")
    wrapper = lifeline.wrapper_argv(["/bin/echo", "ran"], ppid=os.getpid())
    res = subprocess.run(wrapper, capture_output=True, text=True, timeout=30)
    assert (res.returncode, res.stdout) == (0, "ran\n")


def test_child_of_tangram_up_exits_when_its_parent_is_already_gone() -> None:
    """A Python child started by `tangram up` whose parent died before it armed itself exits
    at once instead of running as an orphan."""
    code = "from tangram_celery.common.lifeline import arm_from_env; arm_from_env(); print('ran')"
    env = dict(os.environ, **{lifeline.PARENT_ENV: "1"})
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert (res.returncode, res.stdout) == (lifeline.EXIT_ORPHANED, "")


def test_launcher_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """'auto' takes the built-in launcher (its start has no window where a killed parent leaves a
    child behind), bubblewrap only when the built-in one is unavailable; asking for a launcher
    that is missing says what to do."""
    from tangram_celery.sandbox import namespace
    from tangram_celery.sandbox.namespace import resolve_launcher

    assert resolve_launcher("auto") == "builtin"
    monkeypatch.setenv("TANGRAM_PRETEND_MISSING", "bwrap")
    assert resolve_launcher("auto") == "builtin"
    with pytest.raises(SandboxError, match="apt-get install bubblewrap"):
        resolve_launcher("bwrap")
    monkeypatch.setenv("TANGRAM_PRETEND_MISSING", "builtin")
    with pytest.raises(SandboxError, match="built-in launcher is disabled"):
        resolve_launcher("builtin")
    monkeypatch.setattr(namespace.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert resolve_launcher("auto") == "bwrap"
    monkeypatch.setenv("TANGRAM_PRETEND_MISSING", "bwrap,builtin")
    with pytest.raises(SandboxError, match="built-in launcher is disabled"):
        resolve_launcher("auto")
