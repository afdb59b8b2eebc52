"""Grading a trajectory in an image: its verdict from a clean copy of its sources.

A `grade` action judges what a trajectory changed, never the sandbox it changed it in. Its
`test_command` runs in a fresh one-shot sandbox of the trajectory's image whose starting files
are the image plus only the trajectory's changes to regular files under the image's workdir
that are not test infrastructure (`allowed`); then the action's `files` (the hidden tests, as
the task defines them) are written and the command runs under the harness's pytest verdict.
Left out, so the image's originals stay: test modules and directories, pytest's and the
packaging's configuration, `.pth` and site customisation, byte code and caches, package
metadata (entry points load pytest plugins), symlinks and every other non-regular file,
anything outside the workdir (a planted site-packages), and deletions (overlay whiteouts and
opaque directories).

Where the changes come from (`Changes`, a list of (path under the workdir, mode, bytes)):
- namespace backend: the trajectory's upper directory (`layer_changes`; its layer is live) or
  its spill tar (`spill_changes`; evicted). Under overlayfs' metacopy a file whose metadata
  alone changed (the workdir handed to the sandbox user) has no data in the upper directory:
  the image's own data stays, unless a redirect names the image file it was renamed from.
- Docker: the files `container.diff()` names as changed or added, from one `get_archive` of
  the workdir (`container_changes`).
Where they go: a fresh layer's upper directory before its sandbox starts (`seed_layer`), or
the fresh container (`put_changes`), each file owned by the sandbox user with its mode.

Everything the host reads here was written by user code: it never follows a link (each path
is walked from a directory descriptor with O_NOFOLLOW) and copies at most `limit` bytes.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from tangram_celery.common.errors import SandboxError
from tangram_celery.sandbox.limits import SANDBOX_UID

# file names that configure or extend pytest, Python's start or the packaging
INFRA_NAMES = frozenset(
    {
        "conftest.py",
        "pytest.ini",
        ".pytest.ini",
        "pytest.toml",
        ".pytest.toml",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "sitecustomize.py",
        "usercustomize.py",
    }
)
TEST_DIRS = frozenset({"tests", "test", "testing", "__pycache__", ".pytest_cache"})
META_SUFFIXES = (".dist-info", ".egg-info")  # entry points: pytest11 plugins
METACOPY = "trusted.overlay.metacopy"
REDIRECT = "trusted.overlay.redirect"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
MAX_DEPTH = 64


class GradeRefused(SandboxError):
    """The action cannot be graded (the caller's: the result is REJECTED)."""


def dir_allowed(rel: str) -> bool:
    """Whether files under the directory `rel` (relative to the workdir) may be carried over."""
    parts = PurePosixPath(rel).parts
    return not any(p in ("", ".", "..") or p in TEST_DIRS or p.endswith(META_SUFFIXES) for p in parts)


def allowed(rel: str) -> bool:
    """Whether a regular file at `rel` (relative to the workdir) is one the grade carries over."""
    parts = PurePosixPath(rel).parts
    if not parts or not dir_allowed(rel):
        return False
    name = parts[-1]
    if name in INFRA_NAMES or name.endswith((".pth", ".pyc", ".pyo")):
        return False
    return not (name.startswith("test_") and name.endswith(".py")) and not name.endswith("_test.py")


@dataclass
class Changes:
    """The trajectory's carried-over files: (path relative to the workdir, mode, content)."""

    workdir: str
    limit: int
    files: list[tuple[str, int, bytes]] = field(default_factory=list)
    size: int = 0

    def add(self, rel: str, mode: int, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            raise GradeRefused(f"the trajectory's changed files exceed {self.limit >> 20} MiB")
        self.files.append((rel, stat.S_IMODE(mode) & 0o777, data))


def _member_path(root: str, name: str) -> str:
    """The absolute path of a tar member named `name` (`./a/b`, `a/b`) relative to `root`."""
    while name.startswith("./"):
        name = name[2:]
    return str(PurePosixPath(root) / name.lstrip("/")) if name.strip("/.") else root


def _under_workdir(path: str, workdir: str) -> str | None:
    """The absolute `path` relative to `workdir`, or None if outside it (or the workdir)."""
    p, w = PurePosixPath(path), PurePosixPath(workdir)
    try:
        return str(p.relative_to(w)) if p != w else None
    except ValueError:
        return None


# -- from a live upper directory --------------------------------------------------------------
def _walk_to(root_fd: int, parts: tuple[str, ...]) -> int | None:
    """A directory descriptor for `parts` beneath `root_fd`, never through a link; None if any
    component is missing or not a directory."""
    fd = os.dup(root_fd)
    for part in parts:
        try:
            nxt = os.open(part, _DIR, dir_fd=fd)
        except OSError:
            os.close(fd)
            return None
        os.close(fd)
        fd = nxt
    return fd


def layer_changes(upper: Path, workdir: str, rootfs: Path, limit: int) -> Changes:
    """The carried-over files of a live upper directory (see the module doc)."""
    out = Changes(workdir, limit)
    root = os.open(upper, _DIR)
    try:
        top = _walk_to(root, PurePosixPath(workdir).parts[1:])
        if top is not None:
            _walk_upper(top, "", out, rootfs, 0)
    finally:
        os.close(root)
    return out


def _walk_upper(fd: int, rel: str, out: Changes, rootfs: Path, depth: int) -> None:
    try:
        with os.scandir(fd) as it:
            names = sorted(e.name for e in it)
        for name in names:
            path = f"{rel}/{name}" if rel else name
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and depth < MAX_DEPTH and dir_allowed(path):
                sub = _walk_to(fd, (name,))
                if sub is not None:
                    _walk_upper(sub, path, out, rootfs, depth + 1)
            elif stat.S_ISREG(st.st_mode) and allowed(path):
                _copy_upper_file(fd, name, path, out, rootfs)
    finally:
        os.close(fd)


def _xattr(fd: int, name: str) -> bytes | None:
    try:
        return os.getxattr(fd, name)
    except OSError:
        return None


def _copy_upper_file(dir_fd: int, name: str, rel: str, out: Changes, rootfs: Path) -> None:
    try:
        fd = os.open(name, _FILE, dir_fd=dir_fd)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return
        if _xattr(fd, METACOPY) is not None:  # its data is the image's
            redirect = _xattr(fd, REDIRECT)
            if redirect:
                data = _image_file(rootfs, out.workdir, rel, redirect.decode(errors="replace"))
                if data is not None:
                    out.add(rel, st.st_mode, data)
            return
        out.add(rel, st.st_mode, _read_all(fd, out.limit - out.size))
    finally:
        os.close(fd)


def _read_all(fd: int, room: int) -> bytes:
    chunks: list[bytes] = []
    n = 0
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        n += len(chunk)
        if n > room:
            return b"".join(chunks) + chunk  # `Changes.add` refuses it
        chunks.append(chunk)


def _image_file(rootfs: Path, workdir: str, rel: str, redirect: str) -> bytes | None:
    """The image's data of a renamed metacopy file (its redirect: absolute from the root, or a
    name in the same directory), read without following links; None if not a regular file."""
    here = PurePosixPath(workdir) / rel
    src = PurePosixPath(redirect) if redirect.startswith("/") else here.parent / redirect
    parts = src.parts[1:]
    if not parts or any(p in ("..", ".") for p in parts):
        return None
    root = os.open(rootfs, _DIR)
    try:
        d = _walk_to(root, parts[:-1])
    finally:
        os.close(root)
    if d is None:
        return None
    try:
        fd = os.open(parts[-1], _FILE, dir_fd=d)
    except OSError:
        return None
    finally:
        os.close(d)
    try:
        return _read_all(fd, 1 << 40) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    finally:
        os.close(fd)


# -- from a spill tar or a container's archive ------------------------------------------------
def _tar_changes(
    tar: tarfile.TarFile, root: str, out: Changes, wanted: set[str] | None, rootfs: Path | None
) -> Changes:
    """The carried-over regular files of `tar`, whose names are relative to `root` (absolute);
    with `wanted`, only those absolute paths."""
    for m in tar:
        path = _member_path(root, m.name)
        rel = _under_workdir(path, out.workdir)
        if rel is None or not (m.isreg() or m.islnk()) or not allowed(rel):
            continue
        if wanted is not None and path not in wanted:
            continue
        if "SCHILY.xattr." + METACOPY in m.pax_headers:  # its data is the image's
            redirect = m.pax_headers.get("SCHILY.xattr." + REDIRECT)
            data = _image_file(rootfs, out.workdir, rel, redirect) if redirect and rootfs else None
            if data is not None:
                out.add(rel, m.mode, data)
            continue
        try:
            f = tar.extractfile(m)
        except tarfile.StreamError:  # a hard link in a stream: its target was read already
            continue
        if f is not None:
            out.add(rel, m.mode, f.read(out.limit - out.size + 1))
    return out


def spill_changes(spill: Path, workdir: str, rootfs: Path, limit: int) -> Changes:
    """The carried-over files of an evicted trajectory's spilled layer (a tar of its upper
    directory; members named ./path)."""
    out = Changes(workdir, limit)
    try:
        with tarfile.open(spill, "r:") as tar:
            return _tar_changes(tar, "/", out, None, rootfs)
    except (OSError, tarfile.TarError) as e:
        raise SandboxError(f"the trajectory's kept layer cannot be read: {e}") from None


class _Stream(io.RawIOBase):
    """A file over the chunks of a Docker archive stream."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks, self._buf = chunks, b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf:
            try:
                self._buf = next(self._chunks)
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n], self._buf = self._buf[:n], self._buf[n:]
        return n


def container_changes(container: Any, workdir: str, limit: int) -> Changes:
    """The carried-over files of a trajectory's container: those `diff()` names as changed or
    added (kind 0 or 1), read from one archive of the workdir."""
    out = Changes(workdir, limit)
    try:
        wanted = {str(d["Path"]) for d in container.diff() or [] if d.get("Kind") in (0, 1)}
        if not any(_under_workdir(p, workdir) for p in wanted):
            return out
        chunks, _stat = container.get_archive(workdir)
        raw = io.BufferedReader(_Stream(iter(chunks)), 1 << 20)
        with tarfile.open(fileobj=raw, mode="r|") as tar:
            # the archive's members are named after the workdir's last component
            return _tar_changes(tar, str(PurePosixPath(workdir).parent), out, wanted, None)
    except GradeRefused:
        raise
    except Exception as e:
        raise SandboxError(f"the trajectory's container cannot be read: {e}") from None


# -- into the grading sandbox ------------------------------------------------------------------
def seed_layer(upper: Path, rootfs: Path, changes: Changes) -> None:
    """Write `changes` into a fresh layer's upper directory (no sandbox has seen it yet): new
    directories take the image's mode and owner where the image has them, else 0755 and the
    sandbox user's; a path whose directory the image has as anything but a directory is left out
    (the image's own link or file stays)."""
    base = PurePosixPath(changes.workdir)
    for rel, mode, data in changes.files:
        target = base / rel
        if not _make_dirs(upper, rootfs, target.parent):
            continue
        fd = os.open(
            upper / str(target).lstrip("/"), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600
        )
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchown(fd, SANDBOX_UID, SANDBOX_UID)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)


def _make_dirs(upper: Path, rootfs: Path, path: PurePosixPath) -> bool:
    for i in range(2, len(path.parts) + 1):
        part = PurePosixPath(*path.parts[:i])
        mine = upper / str(part).lstrip("/")
        if mine.is_dir():
            continue
        try:
            st = os.lstat(rootfs / str(part).lstrip("/"))
        except OSError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            return False
        mine.mkdir(mode=0o700)
        uid, gid, mode = (st.st_uid, st.st_gid, st.st_mode) if st else (SANDBOX_UID, SANDBOX_UID, 0o755)
        os.lchown(mine, uid, gid)
        os.chmod(mine, stat.S_IMODE(mode))
    return True


def put_changes(container: Any, changes: Changes) -> None:
    """Copy `changes` into a fresh container (its workdir already the sandbox user's)."""
    if not changes.files:
        return
    buf = io.BytesIO()
    base = PurePosixPath(changes.workdir)
    with tarfile.open(fileobj=buf, mode="w") as tar:
        dirs = sorted(
            {str(p) for rel, _m, _d in changes.files for p in (base / rel).parents if base in p.parents}
        )
        for d in dirs:
            info = tarfile.TarInfo(d.lstrip("/"))
            info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, 0o755, SANDBOX_UID, SANDBOX_UID
            tar.addfile(info)
        for rel, mode, data in changes.files:
            info = tarfile.TarInfo(str(base / rel).lstrip("/"))
            info.size, info.mode, info.uid, info.gid = len(data), mode, SANDBOX_UID, SANDBOX_UID
            tar.addfile(info, io.BytesIO(data))
    try:
        if not container.put_archive("/", buf.getvalue()):
            raise SandboxError("the engine refused the archive")
    except SandboxError:
        raise
    except Exception as e:
        raise SandboxError(f"cannot copy the trajectory's files into the grading container: {e}") from None


# -- the pool's side ---------------------------------------------------------------------------
def trajectory_changes(images: Any, h: Any, tid: str, limit: int) -> tuple[str, Changes]:
    """(image, carried-over files) of trajectory `tid`: from its live sandbox `h` (locked by
    the caller; None when it has none here) or from what this node kept of it (evicted)."""
    if h is not None and h.image is None:
        raise GradeRefused(
            f"trajectory {tid!r} runs on the host toolchain, not in an image: nothing to grade"
        )
    nothing = f"trajectory {tid!r} has no files on this node to grade (no sandbox here, nothing kept)"
    if hasattr(images, "kept_container"):  # Docker: the trajectory's container, live or stopped
        container = h.ref if h is not None and h.ref is not None else images.kept_ref(tid)
        image = h.image if h is not None else images.kept_image(tid)
        if container is None or image is None:
            raise GradeRefused(nothing)
        return image, container_changes(container, images.spec(image)["workdir"], limit)
    if h is not None and h.layer is not None and h.stored is not None:
        return h.image, layer_changes(h.layer.upper, h.workdir, Path(h.stored.rootfs), limit)
    from tangram_celery.sandbox.image_root import WORKDIR_DEFAULT, spill_name

    image = images.kept_image(tid)
    spill = Path(images.store.layers_dir()) / spill_name(tid)
    if image is None or not spill.exists():
        raise GradeRefused(nothing)
    stored = images.store.acquire(image)
    try:
        workdir = stored.spec.workdir or WORKDIR_DEFAULT
        return image, spill_changes(spill, workdir, Path(stored.rootfs), limit)
    finally:
        images.store.release(image)


def seed_before_start(images: Any, h: Any, changes: Changes) -> None:
    """Namespace backend: the grading sandbox's layer, made now, holds `changes` when it starts."""
    if not hasattr(images, "kept_container"):
        images.prepare(h)  # its image and a fresh layer (its start then finds both made)
        seed_layer(h.layer.upper, Path(h.stored.rootfs), changes)


def seed_after_start(images: Any, h: Any, changes: Changes) -> None:
    """Docker: the fresh container gets `changes` once its runner owns the workdir."""
    if hasattr(images, "kept_container"):
        put_changes(h.ref, changes)
