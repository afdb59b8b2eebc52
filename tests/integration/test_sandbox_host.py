"""The host side of sandboxes, on every backend and launcher: what a sandbox can learn about the
host, the directories the host shares with it, tmpfs inode caps, and trajectory ids that only
differ in characters a container name cannot hold."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest

from tangram_celery.common.actions import ActionStatus
from tangram_celery.sandbox import ExecRequest

CHECKOUT = str(Path(__file__).resolve().parents[2])


def tid() -> str:
    return "s-" + uuid.uuid4().hex[:10]


def run(box: Any, traj: str, **kw: Any) -> Any:
    return box.run(traj, ExecRequest(**kw))


def test_mountinfo_names_no_host_path(sandbox_backend: Any, tmp_path: Path) -> None:
    """Given a sandbox, when user code reads /proc/self/mountinfo, then neither the checkout
    path nor the host's temp-dir or state-dir names appear in it (binds come from a neutral
    stage directory)."""
    res = run(sandbox_backend, tid(), language="bash", code="cat /proc/self/mountinfo")
    assert res.status is ActionStatus.OK, res
    text = res.stdout
    assert "/opt/tangram/runner" in text  # the runner is bound: the check looks at the right file
    for leak in (CHECKOUT, "pytest-of-", str(tmp_path), f"{tempfile.gettempdir()}/tangram-", ".tangram"):
        assert leak not in text, f"{leak!r} shows in the sandbox's mountinfo:\n{text}"


def test_kernel_tunables_are_read_only(sandbox_backend: Any) -> None:
    """Given a sandbox, when it looks at /proc/sys, then it is a read-only mount (the runner is
    root of the host's user namespace: sysctls must be out of its reach too)."""
    code = "import os; print(bool(os.statvfs('/proc/sys').f_flag & os.ST_RDONLY))"
    res = run(sandbox_backend, tid(), language="python", code=code)
    assert (res.status, res.stdout) == (ActionStatus.OK, "True\n"), res


def test_runner_state_dir_is_root_only_and_holds_no_host_file(sandbox_backend: Any) -> None:
    """Given a sandbox that ran an action, when the host looks at the directory it shares with
    the sandbox (the runner's socket dir), then it is root-owned 0700 and holds only what the
    runner made: the host writes nothing there (logs live outside it)."""
    traj = tid()
    assert run(sandbox_backend, traj, language="python", code="print(1)").status is ActionStatus.OK
    state_dir = sandbox_backend._handles[traj].state_dir
    st = os.lstat(state_dir)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700)
    assert sorted(os.listdir(state_dir)) == ["runner.sock"]
    stage = sandbox_backend.stage
    assert stat.S_IMODE(os.lstat(stage.dir).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(stage.scope_dir).st_mode) == 0o700


@pytest.mark.parametrize("tamper", ["directory-handed-over", "fake-runner-socket"])
def test_host_does_not_talk_to_a_runner_socket_it_cannot_trust(sandbox_backend: Any, tamper: str) -> None:
    """Given the shared directory handed to the sandbox uid (what a root runner tricked into
    chowning it did), or a socket of the sandbox uid planted as the runner's, when the next
    action runs, then the host refuses to talk to it: nothing of the action reached it, so the
    action runs in a fresh sandbox (reported reset) whose directory is private again, and so
    does the one after."""
    traj = tid()
    assert run(sandbox_backend, traj, language="python", code="print(1)").status is ActionStatus.OK
    state_dir = sandbox_backend._handles[traj].state_dir
    fake = None
    os.chown(state_dir, 10001, 10001)
    if tamper == "fake-runner-socket":
        os.chmod(state_dir, 0o700)
        os.unlink(state_dir / "runner.sock")
        fake = socket.socket(socket.AF_UNIX)
        fake.bind(str(state_dir / "runner.sock"))
        os.chown(state_dir / "runner.sock", 10001, 10001)
        os.chown(state_dir, 0, 0)  # the directory looks fine; the socket is the user's
        fake.listen(1)
        fake.setblocking(False)
    try:
        res = run(sandbox_backend, traj, language="python", code="print(2)")
        assert (res.status, res.stdout, res.sandbox_reset) == (ActionStatus.OK, "2\n", True), res
        if fake is not None:
            with pytest.raises(BlockingIOError):
                fake.accept()  # nobody connected to the fake runner
        fresh = sandbox_backend._handles[traj].state_dir  # a ready sandbox's, when one was
        st = os.lstat(fresh)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700)
        res = run(sandbox_backend, traj, language="python", code="print(3)")
        assert (res.status, res.stdout, res.sandbox_reset) == (ActionStatus.OK, "3\n", False), res
    finally:
        if fake is not None:
            fake.close()


def test_tmpfs_mounts_have_the_configured_inode_cap(sandbox_factory: Any) -> None:
    """Given `inodes_limit: 256`, when user code creates 1000 empty files in /work and in /tmp,
    then each mount refuses them at its cap (ENOSPC), not the memory limit, and the sandbox goes
    on serving."""
    box = sandbox_factory(inodes_limit=256)
    traj = tid()
    code = (
        "import errno, os\n"
        "for d in ('/work', '/tmp'):\n"
        "    print(d, os.statvfs(d).f_files, end=' ')\n"
        "    n = 0\n"
        "    try:\n"
        "        for n in range(1000):\n"
        "            open(f'{d}/f{n}', 'w').close()\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno == errno.ENOSPC, end=' ')\n"
        "    print(n)\n"
        "    for i in range(n):\n"
        "        os.unlink(f'{d}/f{i}')\n"
    )
    res = run(box, traj, language="python", code=code, memory_mb=256)
    lines = res.stdout.split("\n")
    for line, mount in zip(lines, ("/work", "/tmp"), strict=False):
        name, cap, refused, ok, made = line.split()
        assert (name, cap, refused, ok) == (mount, "256", "refused", "True"), res
        assert 200 < int(made) < 256
    nxt = run(box, traj, language="python", code="print('next')")
    assert (nxt.status, nxt.stdout) == (ActionStatus.OK, "next\n")


@pytest.mark.parametrize(
    "ids",
    [("a:b", "a-b"), ("x" * 60 + "-one", "x" * 60 + "-two"), ("ünï/cödé", "_n_/c_d_")],
    ids=["punctuation", "shared-60-char-prefix", "non-ascii"],
)
def test_trajectory_ids_that_sanitise_alike_get_their_own_sandboxes(
    sandbox_backend: Any, ids: tuple[str, str]
) -> None:
    """Given two trajectory ids that differ only in characters a container name cannot hold (or
    after 60 characters), when both write a file, then each sees only its own."""
    for i, traj in enumerate(ids):
        res = run(sandbox_backend, traj, language="bash", code=f"echo {i} > mine")
        assert res.status is ActionStatus.OK, res
    for i, traj in enumerate(ids):
        res = run(sandbox_backend, traj, language="bash", code="cat mine")
        assert res.stdout == f"{i}\n", (traj, res)
    for traj in ids:
        sandbox_backend.close_trajectory(traj)
