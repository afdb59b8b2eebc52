"""The runner's file operations in paths user code can influence (stdlib only).

Earlier actions' code may have planted symlinks, FIFOs or read-only directories in /work and
/tmp. Everything here runs with the runner's *filesystem* uid and gid switched to the sandbox
user's (setfsuid/setfsgid, which also drops the file capabilities CHOWN, DAC_OVERRIDE and FOWNER
while in force), so a planted link leads at most where user code could write itself: a link to
/run/tangram, /opt/tangram or /proc/1/... ends in EACCES/EROFS, not in a root write. Files are
created as the sandbox user directly, so nothing needs a chown. The final path component is never
followed (O_NOFOLLOW; a link or FIFO there is replaced by the file). No user process is alive while
these run (the runner kills the last action's processes before it answers), so there is no race
to win, only planted state.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from typing import Any

UNITS = {"python": "main.py", "bash": "main.sh", "c": "main.c"}
DISK_SLACK_B = 256 * 1024  # a workdir with less free space than this counts as full
INODE_SLACK = 16  # ... and one with fewer free inodes than this
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_fsid: list[Any] = []


def _fs_calls() -> tuple[Any, Any]:
    if not _fsid:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        _fsid.extend([libc.setfsuid, libc.setfsgid])
    return _fsid[0], _fsid[1]


@contextlib.contextmanager
def as_user(uid: int) -> Iterator[None]:
    """File permission checks (and new files' owner) as `uid` inside the block."""
    setfsuid, setfsgid = _fs_calls()
    setfsgid(uid)
    setfsuid(uid)
    try:
        if setfsuid(-1) != uid or setfsgid(-1) != uid:  # -1 is never valid: returns the current id
            raise PermissionError("cannot switch the filesystem uid to the sandbox user")
        yield
    finally:
        setfsuid(0)
        setfsgid(0)


def reset_tops(req: dict) -> None:
    """The workdir and /tmp back to their owner and mode (user code may have chmod'ed them, which
    would lock the runner's user-uid file operations out). Both are mount points, never links."""
    uid = int(req["uid"])
    for path, mode in ((req["workdir"], 0o755), ("/tmp", 0o1777)):
        try:
            os.chown(path, uid, uid, follow_symlinks=False)
            os.chmod(path, mode)
        except OSError:
            pass


def write_files(req: dict) -> str | None:
    """Write `files` and the code unit into the workdir as the sandbox user. Returns why one
    could not be written (a user-caused failure: a directory where a file goes, a link to a
    place the user cannot write), or None."""
    files: dict[str, bytes] = {
        rel: text.encode("utf-8", "surrogatepass") for rel, text in (req.get("files") or {}).items()
    }
    for rel, b64 in (req.get("binary_files") or {}).items():
        files[rel] = base64.b64decode(b64)
    if req.get("code") is not None:
        files[UNITS[req["language"]]] = req["code"].encode("utf-8", "surrogatepass")
    with as_user(int(req["uid"])):
        for rel, content in files.items():
            path = os.path.join(req["workdir"], rel)
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                _write(path, content)
            except OSError as e:
                return f"cannot write files entry {rel!r}: {e.strerror or e}"
    return None


def fetch_files(req: dict) -> dict[str, str]:
    """{path: base64} of the requested files, read after every process of the action is gone,
    as the sandbox user: only regular files owned by it, resolved inside the workdir or /tmp,
    opened without following a final link; a missing file, anything else, or what exceeds
    `max_fetch_bytes` in all is left out."""
    out: dict[str, str] = {}
    budget = int(req.get("max_fetch_bytes", 16 << 20))
    roots = tuple(os.path.realpath(r) + os.sep for r in (req["workdir"], "/tmp"))
    with as_user(int(req["uid"])):
        for name in req["fetch_files"]:
            path = os.path.realpath(os.path.join(req["workdir"], name))
            if not path.startswith(roots):
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != int(req["uid"]) or st.st_size > budget:
                    continue
                data = os.read(fd, st.st_size + 1)
                if len(data) > budget:
                    continue
                budget -= len(data)
                out[name] = base64.b64encode(data).decode("ascii")
            finally:
                os.close(fd)
    return out


def _write(path: str, data: bytes) -> None:
    try:
        fd = os.open(path, _WRITE_FLAGS, 0o644)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EWOULDBLOCK):
            raise
        fd = _replace(path)  # a symlink or a FIFO sits there
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            fd = _replace(path)
        os.set_blocking(fd, True)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _replace(path: str) -> int:
    os.unlink(path)
    return os.open(path, _WRITE_FLAGS | os.O_EXCL, 0o644)


def inode_marks(req: dict) -> dict[str, tuple[int, int]]:
    """(device, inode number) of an unnamed file created now in the workdir and in /tmp. Both
    are tmpfs mounts, which number inodes from a per-mount counter that only grows: a larger
    number on the same device is a file created later. This needs no clock (a stepped wall clock
    would make an mtime test delete older files), and O_TMPFILE has no name to plant a link at."""
    marks = {}
    with as_user(int(req["uid"])):
        for top in (req["workdir"], "/tmp"):
            try:
                fd = os.open(top, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
            except OSError:  # full already: every file there predates this action
                marks[top] = (os.stat(top).st_dev, 1 << 62)
                continue
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            marks[top] = (st.st_dev, st.st_ino)
    return marks


def roll_back(req: dict, marks: dict[str, tuple[int, int]], since: float) -> list[str]:
    """Once the action filled the quota (space or inodes), delete what it created (files, links,
    directories), so the trajectory can go on. Only if that frees too little, older files it
    wrote to since it started go too, largest first. Returns the removed paths."""
    created: list[str] = []
    created_dirs: list[str] = []
    grown: list[tuple[int, str]] = []
    with as_user(int(req["uid"])):
        for top, (dev, mark) in marks.items():
            for path, st in _walk(top):
                is_dir = stat.S_ISDIR(st.st_mode)
                if st.st_dev == dev and st.st_ino > mark:
                    (created_dirs if is_dir else created).append(path)
                elif not is_dir and st.st_mtime >= since:
                    grown.append((st.st_size, path))
        removed = [p for p in created if _unlink(p)]
        for d in sorted(created_dirs, key=len, reverse=True):  # deepest first
            if _rmdir(d):
                removed.append(d)
        for _size, path in sorted(grown, reverse=True):
            if not disk_full(req):
                break
            if _unlink(path):
                removed.append(path)
    return removed


def _walk(top: str) -> Iterator[tuple[str, os.stat_result]]:
    """(path, lstat) of everything below `top`, never through a link; a directory the action
    made unreadable is opened up again (it is the user's own)."""
    todo = [top]
    while todo:
        d = todo.pop()
        try:
            entries = list(os.scandir(d))
        except PermissionError:
            try:
                os.chmod(d, 0o700)
                entries = list(os.scandir(d))
            except OSError:
                continue
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            yield entry.path, st
            if stat.S_ISDIR(st.st_mode):
                todo.append(entry.path)


def _unlink(path: str) -> bool:
    return _remove(os.unlink, path)


def _rmdir(path: str) -> bool:
    return _remove(os.rmdir, path)


def _remove(remove: Any, path: str) -> bool:
    try:
        remove(path)
    except PermissionError:  # the action made the directory read-only: it is the user's own
        try:
            os.chmod(os.path.dirname(path), 0o700)
            remove(path)
        except OSError:
            return False
    except OSError:
        return False
    return True


def disk_full(req: dict) -> bool:
    """Is /work or /tmp (nearly) out of space or inodes?"""
    for path in (req["workdir"], "/tmp"):
        try:
            st = os.statvfs(path)
        except OSError:
            continue
        if st.f_bavail * st.f_frsize < DISK_SLACK_B:
            return True
        if st.f_files and st.f_favail < INODE_SLACK:
            return True
    return False
