"""The runner's file operations in paths user code can influence (stdlib only).

Earlier actions' code may have planted symlinks, FIFOs or locked directories in /work and /tmp.
The runner is root (CHOWN, DAC_OVERRIDE, FOWNER), so nothing here may follow a link: `files` are
written by walking the path one component at a time from the workdir with `openat`
(O_NOFOLLOW | O_DIRECTORY: a link in place of a directory is refused, as a link to /run/tangram,
/opt/tangram or /proc/1/... would otherwise lead a root write there), the last component is
opened with O_NOFOLLOW (a link or FIFO there is replaced by the file), and what root creates is
handed to the sandbox user by descriptor (fchown). The roll-back walks without following links
and removes by name. No user process is alive while any of this runs (the runner kills the last
action's processes before it answers), so there is no race to win, only planted state.

(Not by switching the filesystem uid to the user's: a change of the filesystem uid clears the
runner's parent-death signal, which keeps it from outliving its worker.)
"""

from __future__ import annotations

import base64
import errno
import os
import stat
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tangram_runner.langs import unit

if TYPE_CHECKING:
    from tangram_runner.protocol import RunRequest, Seat

DISK_SLACK_B = 256 * 1024  # a workdir with less free space than this counts as full
INODE_SLACK = 16  # ... and one with fewer free inodes than this
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class PlantedLink(OSError):
    """A link (or other non-directory) where a directory of a `files` path must be."""


def reset_tops(seat: Seat) -> None:
    """The workdir and /tmp back to their owner and mode (user code may have chmod'ed them).
    Both are mount points, never links."""
    uid = int(seat.uid)
    for path, mode in ((seat.workdir, 0o755), ("/tmp", 0o1777)):
        try:
            os.chown(path, uid, uid, follow_symlinks=False)
            os.chmod(path, mode)
        except OSError:
            pass


def write_files(req: RunRequest, seat: Seat) -> str | None:
    """Write `files`, `binary_files` and the code unit into the workdir, owned by the sandbox
    user. Returns why one could not be written (a user-caused failure: a link or a file where a
    directory of the path must be, a directory where the file goes), or None."""
    files: dict[str, bytes] = {
        rel: text.encode("utf-8", "surrogatepass") for rel, text in (req.files or {}).items()
    }
    for rel, b64 in (req.binary_files or {}).items():
        files[rel] = base64.b64decode(b64)
    if req.code is not None:
        files[unit(req.language, req.code)] = req.code.encode("utf-8", "surrogatepass")
    uid = int(seat.uid)
    for rel, content in files.items():
        try:
            _write_at(seat.workdir, rel.split("/"), content, uid)
        except PlantedLink as e:
            return f"cannot write files entry {rel!r}: {e}"
        except OSError as e:
            return f"cannot write files entry {rel!r}: {e.strerror or e}"
    return None


def _write_at(top: str, parts: list[str], data: bytes, uid: int) -> None:
    dirfd = os.open(top, _DIR_FLAGS)
    try:
        for name in parts[:-1]:
            try:
                os.mkdir(name, 0o755, dir_fd=dirfd)
                os.chown(name, uid, uid, dir_fd=dirfd, follow_symlinks=False)
            except FileExistsError:
                pass
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=dirfd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise PlantedLink(e.errno, f"{name!r} is a link or a file, not a directory") from None
                raise
            os.close(dirfd)
            dirfd = nxt
        _write_file(dirfd, parts[-1], data, uid)
    finally:
        os.close(dirfd)


def _write_file(dirfd: int, name: str, data: bytes, uid: int) -> None:
    try:
        fd = os.open(name, _WRITE_FLAGS, 0o644, dir_fd=dirfd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EWOULDBLOCK):
            raise
        fd = _replace(dirfd, name)  # a link or a FIFO sits there
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            fd = _replace(dirfd, name)
        os.set_blocking(fd, True)
        os.fchown(fd, uid, uid)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _replace(dirfd: int, name: str) -> int:
    os.unlink(name, dir_fd=dirfd)  # removes a link itself, never its target
    return os.open(name, _WRITE_FLAGS | os.O_EXCL, 0o644, dir_fd=dirfd)


def fetch_files(req: RunRequest, seat: Seat) -> dict[str, str]:
    """{path: base64} of the requested files, read after every process of the action is gone:
    only regular files owned by the sandbox user, resolved inside the workdir or /tmp, opened
    without following a final link; a missing file, anything else, or what exceeds
    `max_fetch_bytes` in all is left out."""
    out: dict[str, str] = {}
    budget = int(req.max_fetch_bytes)
    roots = tuple(os.path.realpath(r) + os.sep for r in (seat.workdir, "/tmp"))
    for name in req.fetch_files:
        path = os.path.realpath(os.path.join(seat.workdir, name))
        if not path.startswith(roots):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != int(seat.uid) or st.st_size > budget:
                continue
            data = os.read(fd, st.st_size + 1)
            if len(data) > budget:
                continue
            budget -= len(data)
            out[name] = base64.b64encode(data).decode("ascii")
        finally:
            os.close(fd)
    return out


def inode_marks(seat: Seat) -> dict[str, tuple[int, int]]:
    """(device, inode number) of an unnamed file created now in the workdir and in /tmp. Both
    are tmpfs mounts, which number inodes from a per-mount counter that only grows: a larger
    number on the same device is a file created later. This needs no clock (a stepped wall clock
    would make an mtime test delete older files), and O_TMPFILE has no name to plant a link at."""
    marks = {}
    for top in (seat.workdir, "/tmp"):
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


def roll_back(seat: Seat, marks: dict[str, tuple[int, int]], since: float) -> list[str]:
    """Once the action filled the quota (space or inodes), delete what it created (files, links,
    directories), so the trajectory can go on. Only if that frees too little, older files it
    wrote to since it started go too, largest first. Returns the removed paths."""
    created: list[str] = []
    created_dirs: list[str] = []
    grown: list[tuple[int, str]] = []
    for top, (dev, mark) in marks.items():
        for path, st in _walk(top):
            is_dir = stat.S_ISDIR(st.st_mode)
            if st.st_dev == dev and st.st_ino > mark:
                (created_dirs if is_dir else created).append(path)
            elif not is_dir and st.st_mtime >= since:
                grown.append((st.st_size, path))
    removed = [p for p in created if _remove(os.unlink, p)]
    for d in sorted(created_dirs, key=len, reverse=True):  # deepest first
        if _remove(os.rmdir, d):
            removed.append(d)
    for _size, path in sorted(grown, reverse=True):
        if not disk_full(seat):
            break
        if _remove(os.unlink, path):
            removed.append(path)
    return removed


def _walk(top: str) -> Iterator[tuple[str, os.stat_result]]:
    """(path, lstat) of everything below `top`, descending only into real directories (every
    directory of a returned path was seen as one: removing by path follows no link)."""
    todo = [top]
    while todo:
        d = todo.pop()
        try:
            entries = list(os.scandir(d))
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


def _remove(remove: Any, path: str) -> bool:
    try:
        remove(path)
    except OSError:
        return False
    return True


def disk_full(seat: Seat) -> bool:
    """Is /work or /tmp (nearly) out of space or inodes?"""
    for path in (seat.workdir, "/tmp"):
        try:
            st = os.statvfs(path)
        except OSError:
            continue
        if st.f_bavail * st.f_frsize < DISK_SLACK_B:
            return True
        if st.f_files and st.f_favail < INODE_SLACK:
            return True
    return False
