"""The runner's file operations in the workdir, run here as root like the runner: links and FIFOs
planted by earlier user code never redirect a privileged write."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tangram_runner import fs
from tangram_runner.protocol import RunRequest, Seat
from tests.fixtures.runner import run_request, seat

pytestmark = [
    pytest.mark.skipif(os.getuid() != 0, reason="writing files for another uid needs root"),
]
USER = 65534  # nobody


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A user-owned workdir on a tmpfs (as /work is), next to a root-only directory (the
    runner's state, say)."""
    base = Path(tempfile.mkdtemp(prefix="tangram-fs-", dir="/dev/shm"))
    os.chmod(base, 0o711)  # the user reaches its workdir, as it reaches /work
    work = base / "work"
    work.mkdir()
    os.chown(work, USER, USER)
    secret = base / "state"
    secret.mkdir(mode=0o700)
    (secret / "runner.sock").write_text("")
    yield work
    shutil.rmtree(base, ignore_errors=True)


def req(files: dict[str, str], code: str | None = None) -> RunRequest:
    return run_request(files=files, code=code)


def user(work: Path) -> Seat:
    return seat(work, USER)


def test_files_are_written_as_the_user(workdir: Path) -> None:
    """Given a nested files entry and code, when written, then both exist, owned by the user."""
    assert fs.write_files(req({"a/b/c.txt": "hi"}, code="print(1)"), user(workdir)) is None
    for p in (workdir / "a", workdir / "a/b", workdir / "a/b/c.txt", workdir / "main.py"):
        assert p.stat().st_uid == USER, p
    assert (workdir / "a/b/c.txt").read_text() == "hi"


def test_a_link_to_a_root_only_directory_leads_nowhere(workdir: Path) -> None:
    """Given a link planted into a root-only directory, when a files entry goes through it, then
    the write is refused (a link where a directory must be), and nothing appears there."""
    state = workdir.parent / "state"
    (workdir / "lnk").symlink_to(state)
    why = fs.write_files(req({"lnk/x": "pwned"}), user(workdir))
    assert why is not None and "lnk/x" in why
    why = fs.write_files(req({"lnk/sub/x": "pwned"}), user(workdir))
    assert why is not None
    assert sorted(p.name for p in state.iterdir()) == ["runner.sock"]
    st = state.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700)


def test_a_link_or_fifo_in_the_last_component_is_replaced_not_followed(workdir: Path) -> None:
    """Given main.py planted as a link to a root-only file and a FIFO where a file goes, when the
    code and files are written, then both become plain user files and the link's target is
    untouched (and nothing hangs on the FIFO)."""
    target = workdir.parent / "state" / "runner.sock"
    (workdir / "main.py").symlink_to(target)  # planted by user code
    os.mkfifo(workdir / "fifo")
    assert fs.write_files(req({"fifo": "data"}, code="print(2)"), user(workdir)) is None
    assert not (workdir / "main.py").is_symlink() and (workdir / "main.py").read_text() == "print(2)"
    assert (workdir / "main.py").stat().st_uid == USER
    assert stat.S_ISREG((workdir / "fifo").lstat().st_mode) and (workdir / "fifo").read_text() == "data"
    assert target.read_text() == ""


def test_roll_back_removes_what_the_action_created_through_no_link(workdir: Path) -> None:
    """Given a mark, then files, a directory tree and a link created after it, when rolled back,
    then all of them are gone and the link's target is kept, as is a file older than the mark."""
    (workdir / "old.txt").write_text("keep")
    os.chown(workdir / "old.txt", USER, USER)
    marks = {str(workdir): fs.inode_marks(user(workdir))[str(workdir)]}  # (not the host's /tmp)
    outside = workdir.parent / "outside.txt"
    outside.write_text("keep too")
    assert fs.write_files(req({"d/e/f.txt": "x", "g.txt": "y"}), user(workdir)) is None
    (workdir / "link").symlink_to(outside)
    os.chmod(workdir / "d", 0o500)  # the action locked its own directory
    removed = fs.roll_back(user(workdir), marks, since=0.0)
    assert {Path(p).name for p in removed} >= {"f.txt", "g.txt", "link", "e", "d"}
    assert sorted(p.name for p in workdir.iterdir()) == ["old.txt"]
    assert outside.read_text() == "keep too"
