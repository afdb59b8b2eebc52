"""Unpack image layers into a root filesystem, never writing outside it.

Python's tarfile reads the stream; every member is checked and applied here (not `extractall`):
- a name that is absolute or has a `..` part, or whose parent is a symlink or not a directory, is
  refused (`ImageCorrupt`): parents are walked from the rootfs with O_NOFOLLOW directory fds, and
  every file is made relative to its parent's fd, so nothing a layer plants can redirect a write;
- a hard link's target must be inside the rootfs (the same checks) and already there;
- OCI whiteouts: `.wh.NAME` removes NAME of a lower layer, `.wh..wh..opq` empties its directory of
  lower layers' entries (what the same layer adds stays);
- device nodes are skipped; setuid/setgid bits of files are dropped (counted and logged); extended
  attributes (file capabilities among them) are not applied; owners are kept when we are root;
- a gzip layer is decompressed here; a zstd one is refused; the blob digest (as stored) and the
  diff_id (uncompressed) are checked after the whole stream is read.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import io
import logging
import os
import shutil
import stat
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, cast

from tangram_celery.sandbox.oci import ImageCorrupt

log = logging.getLogger(__name__)
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MAX_CACHED_FDS = 128  # directory fds a layer's unpack keeps open (a worker may have only 1024)


class _Hashing(io.RawIOBase):
    """A reader that hashes (sha256) and counts what passes through it."""

    def __init__(self, inner: IO[bytes]) -> None:
        self.inner = inner
        self.hash = hashlib.sha256()
        self.nbytes = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self.inner.read(len(b))
        n = len(data)
        b[:n] = data
        self.hash.update(data)
        self.nbytes += n
        return n

    def digest(self) -> str:
        return f"sha256:{self.hash.hexdigest()}"


def _drain(f: IO[bytes]) -> None:
    while f.read(_CHUNK):
        pass


@dataclass
class _Layer:
    """The state of one layer's unpack."""

    root_fd: int
    what: str  # for messages: image ref and layer index
    as_root: bool = False
    created: set[tuple[str, ...]] = field(default_factory=set)
    dirs: list[tuple[tuple[str, ...], tarfile.TarInfo]] = field(default_factory=list)
    dropped_suid: list[str] = field(default_factory=list)
    devices: int = 0
    fds: dict[tuple[str, ...], int] = field(default_factory=dict)  # open directories


def _parts(name: str, what: str) -> tuple[str, ...]:
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if name.startswith("/") or ".." in parts:
        raise ImageCorrupt(f"{what}: member {name!r} is absolute or leaves the root filesystem")
    return parts


def _dir_fd(st: _Layer, dparts: tuple[str, ...], full: tuple[str, ...], create: bool) -> int | None:
    """An fd (cached for the layer; not the caller's to close) of the directory `dparts`, walked
    with O_NOFOLLOW from the rootfs: a symlink or a file on the way is refused. None when absent
    and not `create`."""
    if not dparts:
        return st.root_fd
    cached = st.fds.get(dparts)
    if cached is not None:
        return cached
    parent = _dir_fd(st, dparts[:-1], full, create)
    if parent is None:
        return None
    comp = dparts[-1]
    try:
        fd = os.open(comp, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            return None
        os.mkdir(comp, 0o755, dir_fd=parent)
        fd = os.open(comp, _DIR_FLAGS, dir_fd=parent)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise ImageCorrupt(
            f"{st.what}: {'/'.join(full)!r} passes through {comp!r}, a symlink or not a directory"
        ) from None
    st.fds[dparts] = fd
    return fd


@contextlib.contextmanager
def _parent(st: _Layer, parts: tuple[str, ...], create: bool) -> Iterator[int | None]:
    """The fd of the directory holding `parts` (see `_dir_fd`)."""
    yield _dir_fd(st, parts[:-1], parts, create)


def _forget_fds(st: _Layer, below: tuple[str, ...] = ()) -> None:
    """Close the cached fds of `below` and the directories under it (all by default)."""
    for key in [k for k in st.fds if k[: len(below)] == below]:
        os.close(st.fds.pop(key))


def _remove(st: _Layer, dparts: tuple[str, ...], fd: int, name: str) -> None:
    """Remove `name` (anything) from the directory `dparts` open at `fd`."""
    try:
        info = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        _forget_fds(st, (*dparts, name))
        shutil.rmtree(name, dir_fd=fd)
    else:
        os.unlink(name, dir_fd=fd)


def _is_dir(fd: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _whiteout(st: _Layer, parts: tuple[str, ...]) -> None:
    base = parts[-1]
    with _parent(st, parts, create=False) as fd:
        if fd is None:
            return
        if base == OPAQUE:
            for child in os.listdir(fd):
                if (*parts[:-1], child) not in st.created:
                    _remove(st, parts[:-1], fd, child)
        elif not base.startswith(WHITEOUT * 2):  # `.wh..wh.*` other than opq: aufs bookkeeping
            target = base[len(WHITEOUT) :]
            if target in ("", ".", "..") or "/" in target:
                raise ImageCorrupt(f"{st.what}: bad whiteout {'/'.join(parts)!r}")
            if (*parts[:-1], target) not in st.created:
                _remove(st, parts[:-1], fd, target)


def _mode(st: _Layer, m: tarfile.TarInfo, path: str) -> int:
    mode = m.mode & 0o7777
    if m.isdir():
        return mode & ~stat.S_ISUID
    if mode & (stat.S_ISUID | stat.S_ISGID):
        st.dropped_suid.append(path)
        mode &= ~(stat.S_ISUID | stat.S_ISGID)
    return mode


def _write_file(st: _Layer, tf: tarfile.TarFile, m: tarfile.TarInfo, fd: int, name: str, path: str) -> None:
    ffd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
    with os.fdopen(ffd, "wb") as out:
        src = tf.extractfile(m)
        if src is not None:
            shutil.copyfileobj(src, out, _CHUNK)
        out.flush()
        if st.as_root:
            os.fchown(ffd, m.uid, m.gid)
        os.fchmod(ffd, _mode(st, m, path))
        os.utime(ffd, (m.mtime, m.mtime))


def _link(st: _Layer, m: tarfile.TarInfo, fd: int, name: str) -> None:
    target = _parts(m.linkname, st.what)
    if not target:
        raise ImageCorrupt(f"{st.what}: hard link {m.name!r} to the root directory")
    with _parent(st, target, create=False) as sfd:
        try:
            if sfd is None:
                raise FileNotFoundError(m.linkname)
            os.link(target[-1], name, src_dir_fd=sfd, dst_dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            raise ImageCorrupt(f"{st.what}: hard link {m.name!r} to missing {m.linkname!r}") from None


def _apply(st: _Layer, tf: tarfile.TarFile, m: tarfile.TarInfo) -> None:
    if len(st.fds) > MAX_CACHED_FDS:  # here, where no fd of the cache is in use
        _forget_fds(st)
    parts = _parts(m.name, st.what)
    if not parts:
        return  # the root directory itself: the store owns its mode
    if parts[-1].startswith(WHITEOUT):
        _whiteout(st, parts)
        return
    if m.ischr() or m.isblk():
        st.devices += 1
        return
    path = "/" + "/".join(parts)
    with _parent(st, parts, create=True) as fd:
        assert fd is not None
        name = parts[-1]
        if m.isdir():
            if not _is_dir(fd, name):
                _remove(st, parts[:-1], fd, name)
                os.mkdir(name, 0o700, dir_fd=fd)
            st.dirs.append((parts, m))  # owner and mode once the layer is in: a 0555 dir stays writable
        else:
            _remove(st, parts[:-1], fd, name)
            if m.issym():
                os.symlink(m.linkname, name, dir_fd=fd)
                if st.as_root:
                    os.chown(name, m.uid, m.gid, dir_fd=fd, follow_symlinks=False)
            elif m.islnk():
                _link(st, m, fd, name)
            elif m.isfifo():
                os.mkfifo(name, _mode(st, m, path), dir_fd=fd)
            else:
                _write_file(st, tf, m, fd, name, path)
    st.created.add(parts)


def _finish_dirs(st: _Layer) -> None:
    for parts, m in reversed(st.dirs):  # children first: a parent's mode may forbid what follows
        if len(st.fds) > MAX_CACHED_FDS:
            _forget_fds(st)
        with _parent(st, parts, create=False) as fd:
            if fd is None:
                continue
            try:
                dfd = os.open(parts[-1], _DIR_FLAGS, dir_fd=fd)
            except OSError:
                continue  # replaced later in the same layer by a non-directory
            try:
                if st.as_root:
                    os.fchown(dfd, m.uid, m.gid)
                os.fchmod(dfd, _mode(st, m, "/".join(parts)))
                os.utime(dfd, (m.mtime, m.mtime))
            finally:
                os.close(dfd)


def _tar_stream(raw: _Hashing, what: str, media_type: str) -> tuple[IO[bytes], _Hashing]:
    """The uncompressed tar stream of a blob, and the hasher of that stream (its diff_id)."""
    buffered = io.BufferedReader(raw, _CHUNK)
    head = buffered.peek(4)[:4]
    if head == _ZSTD_MAGIC or "zstd" in media_type:
        raise ImageCorrupt(f"{what}: zstd-compressed layers are not supported (use gzip or none)")
    inner: IO[bytes] = buffered
    if head[:2] == b"\x1f\x8b":
        inner = cast(IO[bytes], gzip.GzipFile(fileobj=buffered, mode="rb"))
    plain = _Hashing(inner)
    return io.BufferedReader(plain, _CHUNK), plain


def unpack_layer(
    blob: IO[bytes],
    root_fd: int,
    *,
    what: str,
    diff_id: str,
    digest: str | None = None,
    media_type: str = "",
) -> None:
    """Apply one layer blob (plain or gzip tar) onto the rootfs open at `root_fd`; raise
    ImageCorrupt when a member tries to escape or a digest does not match."""
    raw = _Hashing(blob)
    st = _Layer(root_fd, what, as_root=os.geteuid() == 0)
    try:
        stream, plain = _tar_stream(raw, what, media_type)
        with tarfile.open(fileobj=stream, mode="r|") as tf:
            for m in tf:
                _apply(st, tf, m)
            _finish_dirs(st)
        _drain(stream)  # the tar's trailing blocks: the diff_id covers the whole stream
        while raw.read(_CHUNK):  # and the blob's: its digest too
            pass
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ImageCorrupt(f"{what}: not a readable layer tar: {e}") from None
    finally:
        _forget_fds(st)
    if digest is not None and raw.digest() != digest:
        raise ImageCorrupt(f"{what}: blob digest {raw.digest()} is not the manifest's {digest}")
    if plain.digest() != diff_id:
        raise ImageCorrupt(f"{what}: uncompressed digest {plain.digest()} is not the config's {diff_id}")
    if st.dropped_suid:
        log.warning(
            "%s: dropped setuid/setgid bits of %d file(s), e.g. %s",
            what,
            len(st.dropped_suid),
            st.dropped_suid[0],
        )
    if st.devices:
        log.info("%s: skipped %d device node(s)", what, st.devices)


def tree_bytes(root: Path) -> int:
    """Disk use of a tree, bytes (allocated blocks; a hard-linked inode counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            try:
                s = os.stat(os.path.join(dirpath, name), follow_symlinks=False)
            except OSError:
                continue
            if s.st_nlink > 1 and not stat.S_ISDIR(s.st_mode):
                if (s.st_dev, s.st_ino) in seen:
                    continue
                seen.add((s.st_dev, s.st_ino))
            total += s.st_blocks * 512
    return total
